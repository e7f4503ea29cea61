"""The gateway as the Gateway API Inference Extension's endpoint picker: Envoy's external processing
(ext_proc, gRPC) following GIE's endpoint picker protocol, with the same rules as the HTTP relay
(admission.py). server.py opens the port, servicer.py answers each request's stream, responses.py turns
decisions into ext_proc messages, health.py serves grpc.health.v1. docs/inference-extension.md says why."""
