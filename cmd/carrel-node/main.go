// Command carrel-node is carreld's Kubernetes node helper: carreld
// --kubeconfig starts it, and it registers the host's Node, renews its
// Lease, publishes its GPUs and boots the AgentVM runs placed on it
// (supervisor/node, supervisor/node/kube). It is a program of its own
// so that carreld does not carry Kubernetes' client: carreld stays as
// small when it is no fleet's node.
//
// carreld hands it two sockets: fd 3, on which carreld serves its API
// (its calls are carreld's own, decided by policy and recorded), and
// fd 4, on which it reports each renewal ("heard MONO") for carreld's
// fence (supervisor/fence; MONO is CLOCK_BOOTTIME) and hears carreld's
// latest audit checkpoint ("checkpoint ORIGIN SIZE ROOT"). It renews the Lease only while
// carreld answers on fd 3, and exits when either socket closes.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/supervisor/fence"
	"github.com/carrel-os/carrel/supervisor/fleet/v1alpha1"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
	"github.com/carrel-os/carrel/supervisor/gpu"
	"github.com/carrel-os/carrel/supervisor/node"
	"github.com/carrel-os/carrel/supervisor/node/kube"
)

var version = "dev"

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "carrel-node:", err)
		os.Exit(1)
	}
}

func run() error {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of this host's Node identity")
	name := flag.String("node-name", "", "the Node's name (default carrel-HOSTNAME)")
	fenceAfter := flag.Duration("fence-after", 30*time.Second, "carreld's fence time (--fleet-fence-after)")
	renew := flag.Duration("renew-interval", 10*time.Second, "how often the Lease is renewed")
	cpus := flag.Int64("cpus", 0, "CPUs offered (0: the host's)")
	memory := flag.Int64("memory", 0, "memory offered in bytes (0: the host's)")
	pods := flag.Int64("pods", 110, "runs the host takes at most")
	driver := flag.String("driver", "qemu", "carreld's driver for new VMs")
	fakeGPUs := flag.String("fake-gpus", "", "tests only: publish the GPUs of the fake sysfs at this root, and boot VMs without them")
	logLevel := flag.String("log-level", "info", "debug, info, warn or error")
	flag.Parse()
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(*logLevel)); err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lv})).With("subsystem", "fleet")
	if *kubeconfig == "" {
		return errors.New("--kubeconfig is required")
	}
	apiConn, err := fdConn(3)
	if err != nil {
		return fmt.Errorf("carreld's API socket (fd 3): %w", err)
	}
	reports, err := fdConn(4)
	if err != nil {
		return fmt.Errorf("carreld's report socket (fd 4): %w", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	rest, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		return fmt.Errorf("kubeconfig: %w", err)
	}
	rest.UserAgent = "carrel-node/" + version
	api := client.New("", client.WithDialer(once(apiConn)))
	var nd *kube.Node
	agent := node.New(node.Config{
		VMs: node.APIVMs{Client: api, WithoutGPUs: *fakeGPUs != ""}, Log: log, FenceAfter: *fenceAfter,
		OnChange: func() { nd.Changed() },
	})
	host := gpu.New(gpu.Config{})
	if *fakeGPUs != "" {
		log.Warn("GPUs are published from a fake sysfs, and VMs boot without them", "sysfs", *fakeGPUs)
		host = gpu.New(gpu.Config{Sysfs: *fakeGPUs})
	}
	c, m := kube.Capacity()
	if *cpus > 0 {
		c = *cpus
	}
	if *memory > 0 {
		m = *memory
	}
	cps := &checkpoints{}
	var writeMu sync.Mutex
	nd, err = kube.New(kube.Config{
		REST: rest, Name: *name, Agent: agent, GPUs: host.List, Driver: *driver,
		CPUs: c, Memory: m, Pods: *pods, Version: version, RenewInterval: *renew, Log: log,
		Audit: cps.latest,
		ApplyPolicy: func(ctx context.Context, name string, files map[string][]byte) error {
			_, err := api.Policies.ApplyPolicy(ctx, connect.NewRequest(&apiv1.ApplyPolicyRequest{Name: name, Files: files}))
			return err
		},
		Alive: func(ctx context.Context) error {
			ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			_, err := api.System.GetInfo(ctx, connect.NewRequest(&apiv1.GetInfoRequest{}))
			return err
		},
		Heard: func(_ time.Time, boot int64) {
			writeMu.Lock()
			defer writeMu.Unlock()
			if _, err := reports.Write([]byte(fence.Report(boot))); err != nil {
				log.Error("carreld is gone: stopping", "err", err)
				stop()
			}
		},
	})
	if err != nil {
		return err
	}
	go func() {
		err := cps.read(reports)
		log.Error("carreld closed the report socket: stopping", "err", err)
		stop()
	}()
	go agent.Watch(ctx, 500*time.Millisecond)
	return nd.Run(ctx)
}

func fdConn(fd uintptr) (net.Conn, error) {
	f := os.NewFile(fd, "fd"+strconv.Itoa(int(fd)))
	if f == nil {
		return nil, errors.New("not open")
	}
	defer f.Close()
	return net.FileConn(f)
}

// once dials c the first time and fails after: carreld's API is one
// HTTP/2 connection, which carries every call.
func once(c net.Conn) func(context.Context) (net.Conn, error) {
	var mu sync.Mutex
	used := false
	return func(context.Context) (net.Conn, error) {
		mu.Lock()
		defer mu.Unlock()
		if used {
			return nil, errors.New("carreld's API connection is closed")
		}
		used = true
		return c, nil
	}
}

// checkpoints holds carreld's latest audit checkpoint, as it reports.
type checkpoints struct {
	mu sync.Mutex
	cp *v1alpha1.AuditCheckpoint
}

func (c *checkpoints) latest() *v1alpha1.AuditCheckpoint {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.cp
}

func (c *checkpoints) read(r net.Conn) error {
	s := bufio.NewScanner(r)
	s.Buffer(make([]byte, 4096), 4096)
	for s.Scan() {
		f := strings.Fields(s.Text())
		if len(f) != 4 || f[0] != "checkpoint" {
			continue
		}
		size, err := strconv.ParseUint(f[2], 10, 64)
		if err != nil {
			continue
		}
		c.mu.Lock()
		c.cp = &v1alpha1.AuditCheckpoint{Origin: f[1], Size: size, RootHash: f[3]}
		c.mu.Unlock()
	}
	return s.Err()
}
