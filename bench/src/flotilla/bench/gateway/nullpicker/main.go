// The null endpoint picker: answers every ext_proc exchange at once, naming one fixed destination (the
// header and the envoy.lb metadata, as Flotilla's picker does after reading the request body). It applies no
// rule: `flotilla gateway bench overhead --bounds` puts it behind Envoy to measure what Envoy and the
// ext_proc exchanges cost on their own, the floor under any picker. A benchmark probe, never served.
package main

import (
	"errors"
	"flag"
	"io"
	"log"
	"net"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/structpb"
)

const destinationHeader = "x-gateway-destination-endpoint"

type nullPicker struct {
	extproc.UnimplementedExternalProcessorServer
	picked *extproc.ProcessingResponse
}

func newNullPicker(destination string) (*nullPicker, error) {
	metadata, err := structpb.NewStruct(map[string]any{
		"envoy.lb": map[string]any{destinationHeader: destination},
	})
	if err != nil {
		return nil, err
	}
	header := &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: destinationHeader, RawValue: []byte(destination)}}
	picked := &extproc.ProcessingResponse{
		Response: &extproc.ProcessingResponse_RequestBody{RequestBody: &extproc.BodyResponse{
			Response: &extproc.CommonResponse{
				HeaderMutation:  &extproc.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{header}},
				ClearRouteCache: true,
			},
		}},
		DynamicMetadata: metadata,
	}
	return &nullPicker{picked: picked}, nil
}

func (p *nullPicker) Process(stream extproc.ExternalProcessor_ProcessServer) error {
	for {
		request, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		var response *extproc.ProcessingResponse
		switch request.Request.(type) {
		case *extproc.ProcessingRequest_RequestHeaders:
			response = &extproc.ProcessingResponse{Response: &extproc.ProcessingResponse_RequestHeaders{RequestHeaders: &extproc.HeadersResponse{}}}
		case *extproc.ProcessingRequest_RequestBody:
			response = p.picked
		case *extproc.ProcessingRequest_ResponseHeaders:
			response = &extproc.ProcessingResponse{Response: &extproc.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extproc.HeadersResponse{}}}
		case *extproc.ProcessingRequest_ResponseBody:
			response = &extproc.ProcessingResponse{Response: &extproc.ProcessingResponse_ResponseBody{ResponseBody: &extproc.BodyResponse{}}}
		default:
			continue // trailers: the bootstrap skips them
		}
		if err := stream.Send(response); err != nil {
			return err
		}
	}
}

func main() {
	listen := flag.String("listen", "127.0.0.1:9002", "the ext_proc address Envoy's picker cluster names")
	destination := flag.String("destination", "", "the ip:port every request is sent to")
	flag.Parse()
	if *destination == "" {
		log.Fatal("--destination is required")
	}
	picker, err := newNullPicker(*destination)
	if err != nil {
		log.Fatal(err)
	}
	listener, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatal(err)
	}
	server := grpc.NewServer()
	extproc.RegisterExternalProcessorServer(server, picker)
	log.Printf("null picker on %s, every request to %s", *listen, *destination)
	log.Fatal(server.Serve(listener))
}
