package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/supervisor/client"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

// portDialTimeout bounds connecting one accepted connection to the guest.
const portDialTimeout = 30 * time.Second

// portSpec is one LOCAL:REMOTE pair.
type portSpec struct {
	local  uint16 // 0: any free port
	remote uint16
}

// parsePortSpec parses LOCAL:REMOTE, or REMOTE alone for the same port on
// both sides.
func parsePortSpec(s string) (portSpec, error) {
	local, remote, pair := strings.Cut(s, ":")
	if !pair {
		local, remote = s, s
	}
	l, err := strconv.ParseUint(local, 10, 16)
	if err != nil {
		return portSpec{}, fmt.Errorf("invalid local port in %q (want LOCAL:REMOTE, e.g. 8080:80)", s)
	}
	r, err := strconv.ParseUint(remote, 10, 16)
	if err != nil || r == 0 {
		return portSpec{}, fmt.Errorf("invalid remote port in %q (want LOCAL:REMOTE, e.g. 8080:80)", s)
	}
	return portSpec{local: uint16(l), remote: uint16(r)}, nil
}

func newPortForwardCmd(g *globals) *cobra.Command {
	var address string
	c := &cobra.Command{
		Use:   "port-forward [--address ADDR] NAME LOCAL:REMOTE...",
		Short: "Forward local TCP ports to ports on a VM's loopback interface, until interrupted",
		Long: `Forward local TCP ports to ports on a VM's loopback interface, until interrupted.

Each LOCAL:REMOTE listens on 127.0.0.1:LOCAL (a LOCAL of 0 picks a free port)
and carries every connection to 127.0.0.1:REMOTE inside the VM, through
carreld and the guest agent; the VM needs no network. A lone PORT means
PORT:PORT. Only --address listens anywhere but the loopback interface.`,
		Example: `  carrel port-forward dev 8080:80
  carrel port-forward dev 0:3000        # prints the local port it picked`,
		Args: cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			name := args[0]
			var specs []portSpec
			for _, a := range args[1:] {
				s, err := parsePortSpec(a)
				if err != nil {
					return err
				}
				specs = append(specs, s)
			}
			if !cmd.Flags().Changed("address") {
				address = "127.0.0.1"
			} else if ip := net.ParseIP(address); ip == nil && address != "localhost" {
				return fmt.Errorf("--address %q: not an IP address", address)
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			cl := g.client()
			resp, err := cl.VMs.GetVM(ctx, connect.NewRequest(&apiv1.GetVMRequest{Name: name}))
			if err != nil {
				return err
			}
			if resp.Msg.Vm.GetState() != apiv1.VMState_VM_STATE_RUNNING {
				return fmt.Errorf("vm %s is not running", name)
			}
			f := &forwarder{client: cl, vm: name, conns: map[io.Closer]struct{}{}}
			var ls []net.Listener
			defer func() {
				for _, l := range ls {
					l.Close()
				}
			}()
			for _, s := range specs {
				l, err := net.Listen("tcp", net.JoinHostPort(address, strconv.Itoa(int(s.local))))
				if err != nil {
					return err
				}
				ls = append(ls, l)
				fmt.Fprintf(cmd.OutOrStdout(), "forwarding %s -> %s:%d\n", l.Addr(), name, s.remote)
			}
			for i, l := range ls {
				go f.serve(l, specs[i].remote)
			}
			<-ctx.Done()
			for _, l := range ls {
				l.Close()
			}
			f.closeAll()
			return nil
		},
	}
	c.Flags().StringVar(&address, "address", "127.0.0.1", "local address to listen on; anything but loopback exposes the VM's port to the network")
	return c
}

// forwarder carries connections accepted on the host to one VM.
type forwarder struct {
	client *client.Client
	vm     string

	mu     sync.Mutex
	conns  map[io.Closer]struct{}
	closed bool
}

func (f *forwarder) serve(l net.Listener, remote uint16) {
	for {
		c, err := l.Accept()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				fmt.Fprintln(os.Stderr, "carrel: port-forward: accept:", err)
			}
			return
		}
		go f.forward(c.(*net.TCPConn), remote)
	}
}

// track adds c to the connections closed at exit; it returns false (and
// closes c) once exiting.
func (f *forwarder) track(c io.Closer) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		c.Close()
		return false
	}
	f.conns[c] = struct{}{}
	return true
}

func (f *forwarder) untrack(c io.Closer) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.conns, c)
	c.Close()
}

func (f *forwarder) closeAll() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.closed = true
	for c := range f.conns {
		c.Close()
	}
}

// forward carries one connection both ways, half-closes included.
func (f *forwarder) forward(local *net.TCPConn, remote uint16) {
	if !f.track(local) {
		return
	}
	defer f.untrack(local)
	ctx, cancel := context.WithTimeout(context.Background(), portDialTimeout)
	rc, err := f.client.DialPort(ctx, f.vm, remote)
	cancel()
	if err != nil {
		fmt.Fprintf(os.Stderr, "carrel: port-forward %s -> %s:%d: %s\n", local.RemoteAddr(), f.vm, remote, describe(err))
		return
	}
	if !f.track(rc) {
		return
	}
	defer f.untrack(rc)
	guest := rc.(client.PortConn)
	errc := make(chan error, 2)
	go func() {
		_, err := io.Copy(guest, local)
		if err == nil {
			err = guest.CloseWrite()
		}
		errc <- err
	}()
	go func() {
		_, err := io.Copy(local, guest)
		if err == nil {
			err = local.CloseWrite()
		}
		errc <- err
	}()
	for range 2 {
		if err := <-errc; err != nil {
			if !errors.Is(err, net.ErrClosed) {
				fmt.Fprintf(os.Stderr, "carrel: port-forward %s -> %s:%d: %s\n", local.RemoteAddr(), f.vm, remote, describe(err))
			}
			return
		}
	}
}
