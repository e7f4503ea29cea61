"""The Gateway API Inference Extension's InferencePool (`inference.networking.k8s.io/v1`): the names the
operator writes and reads of a standard it does not define.

The schema is the standard's own CRD, installed as released (manifests/gie/, whose README names the
version and source); nothing here redefines it. These are the group, kind and the status vocabulary the
desired state (desired/inference_pool.py) uses, spelled once. docs/inference-extension.md says what the
operator writes and why.
"""

from __future__ import annotations

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferencePool"
PLURAL = "inferencepools"
CRD_NAME = f"{PLURAL}.{GROUP}"

APP_PROTOCOL_HTTP = "http"  # spec.appProtocol: HTTP/1.1, the engines' protocol (the standard's default)
FAIL_CLOSE = "FailClose"  # spec.endpointPickerRef.failureMode: no picker, no request (the default)

# status.parents, a list: one entry per parent (typically a Gateway), at most MAX_PARENTS, each with conditions
# of these types and the standard's reasons.
MAX_PARENTS = 32
ACCEPTED = "Accepted"
REASON_ACCEPTED = "Accepted"
RESOLVED_REFS = "ResolvedRefs"
REASON_RESOLVED_REFS = "ResolvedRefs"
REASON_INVALID_EXTENSION_REF = "InvalidExtensionRef"
