// Command fakegpu is the local cluster's GPU device plugin: it speaks the kubelet's device-plugin API
// (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1) as NVIDIA's k8s-device-plugin does, advertising -count
// healthy devices of -resource, and on allocation sets NVIDIA_VISIBLE_DEVICES to the devices given to the
// container. There is no hardware behind them: the kubelet counts, schedules and assigns them for real.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	devices []*pluginapi.Device
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	<-stream.Context().Done() // the devices never change; the kubelet closes the stream when it goes
	return nil
}

func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	response := &pluginapi.AllocateResponse{}
	for _, container := range req.ContainerRequests {
		response.ContainerResponses = append(response.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(container.DevicesIds, ",")},
		})
	}
	return response, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

// serve listens on the plugin's socket and registers it with the kubelet; it returns when the kubelet's
// socket is replaced (a restarted kubelet forgets its plugins) or on a signal.
func serve(p *plugin, dir, socketName, resource string, stop <-chan os.Signal) (bool, error) {
	socket := filepath.Join(dir, socketName)
	_ = os.Remove(socket)
	listener, err := net.Listen("unix", socket)
	if err != nil {
		return false, err
	}
	server := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(server, p)
	go func() { _ = server.Serve(listener) }()
	defer server.Stop()

	kubeletSocket := filepath.Join(dir, "kubelet.sock")
	registered, err := os.Stat(kubeletSocket)
	if err != nil {
		return false, err
	}
	conn, err := grpc.NewClient("unix://"+kubeletSocket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return false, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     socketName,
		ResourceName: resource,
		Options:      &pluginapi.DevicePluginOptions{},
	})
	cancel()
	_ = conn.Close()
	if err != nil {
		return false, fmt.Errorf("registering with the kubelet: %w", err)
	}
	log.Printf("registered %d %s with the kubelet", len(p.devices), resource)
	for {
		select {
		case <-stop:
			return true, nil
		case <-time.After(time.Second):
			current, err := os.Stat(kubeletSocket)
			if err != nil || !os.SameFile(current, registered) {
				log.Printf("the kubelet's socket changed: registering again")
				return false, nil
			}
		}
	}
}

func main() {
	dir := flag.String("dir", pluginapi.DevicePluginPath, "the kubelet's device-plugin folder")
	resource := flag.String("resource", "nvidia.com/gpu", "the extended resource advertised")
	count := flag.Int("count", 8, "how many devices")
	prefix := flag.String("prefix", "GPU-fake", "device ids are PREFIX-<index>")
	flag.Parse()

	p := &plugin{}
	for i := 0; i < *count; i++ {
		p.devices = append(p.devices, &pluginapi.Device{ID: fmt.Sprintf("%s-%d", *prefix, i), Health: pluginapi.Healthy})
	}
	socketName := "fakegpu-" + strings.ReplaceAll(*resource, "/", "_") + ".sock"
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	for {
		done, err := serve(p, *dir, socketName, *resource, stop)
		if done {
			return
		}
		if err != nil {
			log.Printf("%v; retrying", err)
		}
		select {
		case <-stop:
			return
		case <-time.After(time.Second):
		}
	}
}
