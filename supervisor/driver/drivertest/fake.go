// Package drivertest provides a fake driver.Driver for unit tests of the
// code around drivers. Each fake VM serves a scripted guest agent over
// in-memory pipes, so no QEMU is needed.
package drivertest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/driver"
)

// Behavior scripts what the next started VM does.
type Behavior struct {
	// StartErr makes Start fail.
	StartErr error
	// Console is printed on the serial console when the VM resumes.
	Console string
	// ExitOnResume makes the VM exit right after it resumes (a panic); its
	// agent never answers.
	ExitOnResume bool
	// Silent makes the agent never answer.
	Silent bool
	// Files, if set, serves the agent's file service (e.g. a hostile one).
	Files agentv1connect.FileServiceHandler
	// Ports, if set, serves the agent's port service (e.g. a hostile one).
	Ports agentv1connect.PortServiceHandler
	// Process, if set, serves the agent's Process calls (e.g. a hostile
	// guest's; its sends are not capped). By default each command acts
	// like cat, whatever its argv: it starts as pid 100+n with id "fake-n"
	// (the VM's nth command), echoes stdin to stdout and exits 0 when stdin
	// closes; a signal ends it with 128+signal, as the real agent reports a
	// command a signal killed.
	Process func(context.Context, *connect.BidiStream[agentv1.ProcessInput, agentv1.ExecResponse]) error
	// NotReseeded makes Restored answer that the RNG was not reseeded,
	// with this detail (a guest that cannot, or lies).
	NotReseeded string
}

// Driver is a fake driver. Its zero value is not usable: call New.
type Driver struct {
	mu      sync.Mutex
	next    Behavior
	nextPID int
	vms     map[int]*VM
	// Killed counts Kill calls on live VMs.
	Killed int
	faults SnapshotFaults
}

var _ driver.Driver = (*Driver)(nil)

// New returns a fake driver.
func New() *Driver { return &Driver{nextPID: 1000, vms: map[int]*VM{}} }

// VM is one fake VM.
type VM struct {
	Spec     driver.Spec
	behavior Behavior
	exited   chan struct{}
	once     sync.Once
	console  chan net.Conn
	agent    *pipeListener

	mu       sync.Mutex
	from     []byte                     // the saved state it started from
	restored []*agentv1.RestoredRequest // what Restored calls said
	sandbox  *agentv1.SetSandboxRequest // the last one carreld set
	paused   bool
	execs    int      // commands started by Process
	open     []string // the disk files it has open
}

// Paused reports whether carreld paused the VM (Driver.Pause) and has not
// resumed it since.
func (v *VM) Paused() bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.paused
}

// Sandbox returns the sandbox carreld last gave the fake agent, or nil.
func (v *VM) Sandbox() *agentv1.SetSandboxRequest {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.sandbox
}

// Exit ends the VM as if QEMU had exited.
func (v *VM) Exit() {
	v.once.Do(func() {
		close(v.exited)
		v.agent.Close()
	})
}

// SetNext scripts the next Start.
func (d *Driver) SetNext(b Behavior) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.next = b
}

// VM returns the fake VM with pid, or nil.
func (d *Driver) VM(pid int) *VM {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.vms[pid]
}

// Running counts VMs that have not exited.
func (d *Driver) Running() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := 0
	for _, v := range d.vms {
		select {
		case <-v.exited:
		default:
			n++
		}
	}
	return n
}

// Name implements driver.Driver.
func (d *Driver) Name() string { return "fake" }

// Start implements driver.Lifecycle.
func (d *Driver) Start(ctx context.Context, spec driver.Spec) (driver.Instance, error) {
	d.mu.Lock()
	b := d.next
	d.next = Behavior{}
	if b.StartErr != nil {
		d.mu.Unlock()
		return driver.Instance{}, b.StartErr
	}
	if b.ExitOnResume {
		b.Silent = true
	}
	from, err := readIncoming(spec.Incoming)
	if err != nil {
		d.mu.Unlock()
		return driver.Instance{}, err
	}
	d.nextPID++
	pid := d.nextPID
	v := &VM{Spec: spec, behavior: b, exited: make(chan struct{}), console: make(chan net.Conn, 1), agent: newPipeListener(), from: from}
	for _, disk := range spec.Disks {
		v.open = append(v.open, disk.Path)
	}
	d.vms[pid] = v
	d.mu.Unlock()
	serveAgent(v)
	return driver.Instance{Driver: "fake", PID: pid, StartTime: 1, QMPSocket: "fake", CID: spec.CID}, nil
}

func (d *Driver) vm(inst driver.Instance) (*VM, error) {
	v := d.VM(inst.PID)
	if v == nil {
		return nil, driver.ErrNotRunning
	}
	return v, nil
}

// Resume implements driver.Lifecycle.
func (d *Driver) Resume(ctx context.Context, inst driver.Instance) error {
	v, err := d.vm(inst)
	if err != nil {
		return err
	}
	v.mu.Lock()
	wasPaused := v.paused
	v.paused = false
	v.mu.Unlock()
	if wasPaused {
		return nil // a resume after Pause, not the first start
	}
	go func() {
		if v.behavior.Console != "" {
			select {
			case c := <-v.console:
				c.Write([]byte(v.behavior.Console))
			case <-v.exited:
			}
		}
		// A panicking guest exits only after printing its last words.
		if v.behavior.ExitOnResume {
			v.Exit()
		}
	}()
	return nil
}

// Pause implements driver.Lifecycle.
func (d *Driver) Pause(ctx context.Context, inst driver.Instance) error {
	v, err := d.vm(inst)
	if err != nil {
		return err
	}
	v.mu.Lock()
	v.paused = true
	v.mu.Unlock()
	return nil
}

// Adopt implements driver.Lifecycle.
func (d *Driver) Adopt(ctx context.Context, inst driver.Instance) (bool, error) {
	v, err := d.vm(inst)
	if err != nil {
		return false, err
	}
	select {
	case <-v.exited:
		return false, driver.ErrNotRunning
	default:
		return v.Paused(), nil
	}
}

// Wait implements driver.Lifecycle.
func (d *Driver) Wait(ctx context.Context, inst driver.Instance) error {
	v, err := d.vm(inst)
	if err != nil {
		return nil
	}
	select {
	case <-v.exited:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Kill implements driver.Lifecycle.
func (d *Driver) Kill(ctx context.Context, inst driver.Instance) error {
	v, err := d.vm(inst)
	if err != nil {
		return nil
	}
	select {
	case <-v.exited:
	default:
		d.mu.Lock()
		d.Killed++
		d.mu.Unlock()
		v.Exit()
	}
	return nil
}

// Sweep implements driver.Lifecycle: it kills running VMs started for dir
// (the fake's stand-in for QEMU's pid file).
func (d *Driver) Sweep(ctx context.Context, dir string) error {
	d.mu.Lock()
	var left []*VM
	for _, v := range d.vms {
		if v.Spec.Dir == dir && v.Adopt() {
			left = append(left, v)
		}
	}
	d.Killed += len(left)
	d.mu.Unlock()
	for _, v := range left {
		v.Exit()
	}
	return nil
}

// AgentDialer implements driver.Streams.
func (d *Driver) AgentDialer(inst driver.Instance) (driver.Dialer, string) {
	return func(ctx context.Context) (net.Conn, error) {
		v, err := d.vm(inst)
		if err != nil {
			return nil, err
		}
		return v.agent.dial(ctx)
	}, "fake"
}

// ConsoleDialer implements driver.Streams.
func (d *Driver) ConsoleDialer(inst driver.Instance) driver.Dialer {
	return func(ctx context.Context) (net.Conn, error) {
		v, err := d.vm(inst)
		if err != nil {
			return nil, err
		}
		host, guest := net.Pipe()
		select {
		case v.console <- guest:
		default:
			guest.Close()
		}
		go func() { <-v.exited; guest.Close() }()
		return host, nil
	}
}

// agent is the fake guest agent: Exec echoes its argv, Process acts like
// cat, Shutdown powers off, SetSandbox is remembered (VM.Sandbox).
type agent struct {
	agentv1connect.UnimplementedAgentServiceHandler
	vm *VM
}

func (a *agent) Health(context.Context, *connect.Request[agentv1.HealthRequest]) (*connect.Response[agentv1.HealthResponse], error) {
	return connect.NewResponse(&agentv1.HealthResponse{Version: "fake", Transport: "fake"}), nil
}

func (a *agent) Exec(ctx context.Context, req *connect.Request[agentv1.ExecRequest], s *connect.ServerStream[agentv1.ExecResponse]) error {
	for _, arg := range req.Msg.Argv {
		if err := s.Send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stdout{Stdout: []byte(arg + "\n")}}); err != nil {
			return err
		}
	}
	return s.Send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Exit{Exit: &agentv1.ExitStatus{Code: 0}}})
}

// Process serves Behavior.Process, or a cat (see there). As in the real
// agent, a half-close changes nothing, resizes are ignored, and a malformed
// message ends the call with an error. There is nothing to attach to, though
// a start with detach_at_start ends the call after Started, as there.
func (a *agent) Process(ctx context.Context, s *connect.BidiStream[agentv1.ProcessInput, agentv1.ExecResponse]) error {
	if a.vm.behavior.Process != nil {
		return a.vm.behavior.Process(ctx, s)
	}
	first, err := s.Receive()
	if err != nil {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("process: no start or attach message: %w", err))
	}
	switch {
	case first.GetAttach() != nil:
		return connect.NewError(connect.CodeNotFound, fmt.Errorf("process: no detached command %q", first.GetAttach().Id))
	case first.GetStart() == nil:
		return connect.NewError(connect.CodeInvalidArgument, errors.New("process: the first message must be start or attach"))
	}
	a.vm.mu.Lock()
	a.vm.execs++
	n := a.vm.execs
	a.vm.mu.Unlock()
	if err := s.Send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Started{Started: &agentv1.Started{Pid: int32(100 + n), Id: fmt.Sprintf("fake-%d", n)}}}); err != nil {
		return err
	}
	if st := first.GetStart(); st.GetDetach() && st.GetDetachAtStart() {
		return nil // as the real agent: the call ends, the command runs on
	}
	exit := func(code int32, signal string) error {
		return s.Send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Exit{Exit: &agentv1.ExitStatus{Code: code, Signal: signal}}})
	}
	for {
		m, err := s.Receive()
		if errors.Is(err, io.EOF) {
			<-ctx.Done() // the command runs on until the call ends
			return ctx.Err()
		} else if err != nil {
			return err
		}
		switch m := m.Msg.(type) {
		case *agentv1.ProcessInput_Stdin:
			if err := s.Send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stdout{Stdout: m.Stdin}}); err != nil {
				return err
			}
		case *agentv1.ProcessInput_CloseStdin:
			return exit(0, "")
		case *agentv1.ProcessInput_Signal:
			if m.Signal < 1 || m.Signal > 64 {
				return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("process: signal %d is not 1 to 64", m.Signal))
			}
			return exit(128+m.Signal, unix.SignalName(unix.Signal(m.Signal)))
		case *agentv1.ProcessInput_Resize: // no terminal to resize
		default:
			return connect.NewError(connect.CodeInvalidArgument, errors.New("process: start and attach may only come first"))
		}
	}
}

func (a *agent) SetSandbox(_ context.Context, req *connect.Request[agentv1.SetSandboxRequest]) (*connect.Response[agentv1.SetSandboxResponse], error) {
	a.vm.mu.Lock()
	a.vm.sandbox = req.Msg
	a.vm.mu.Unlock()
	return connect.NewResponse(&agentv1.SetSandboxResponse{Detail: "fake agent: no landlock"}), nil
}

func (a *agent) Shutdown(context.Context, *connect.Request[agentv1.ShutdownRequest]) (*connect.Response[agentv1.ShutdownResponse], error) {
	// Like the real agent, power off once the reply is on its way.
	time.AfterFunc(50*time.Millisecond, a.vm.Exit)
	return connect.NewResponse(&agentv1.ShutdownResponse{}), nil
}

// serveAgent serves the fake agent until the VM exits.
func serveAgent(v *VM) {
	if v.behavior.Silent {
		go func() {
			for {
				c, err := v.agent.Accept()
				if err != nil {
					return
				}
				go func() { <-v.exited; c.Close() }()
			}
		}()
		return
	}
	mux := http.NewServeMux()
	// Uncapped sends let a scripted guest break the message limit, so that
	// carreld's cap on what it reads is what a test meets.
	opts := append(protocol.HandlerOptions(), connect.WithSendMaxBytes(0))
	mux.Handle(agentv1connect.NewAgentServiceHandler(&agent{vm: v}, opts...))
	if v.behavior.Files != nil {
		mux.Handle(agentv1connect.NewFileServiceHandler(v.behavior.Files, protocol.HandlerOptions()...))
	}
	if v.behavior.Ports != nil {
		mux.Handle(agentv1connect.NewPortServiceHandler(v.behavior.Ports, protocol.HandlerOptions()...))
	}
	srv := protocol.NewHTTPServer(mux)
	go srv.Serve(v.agent)
	go func() { <-v.exited; srv.Close() }()
}

// CutAgentConnections ends every agent connection the host has made, as
// the host's HTTP/2 keepalive does to a guest paused for longer than it
// waits; the fake agent keeps serving new ones.
func (v *VM) CutAgentConnections() {
	v.agent.mu.Lock()
	hosts := v.agent.hosts
	v.agent.hosts = nil
	v.agent.mu.Unlock()
	for _, c := range hosts {
		c.Close()
	}
}

// pipeListener hands out the guest ends of in-memory connections.
type pipeListener struct {
	conns  chan net.Conn
	closed chan struct{}
	once   sync.Once

	mu    sync.Mutex
	hosts []net.Conn // the host ends handed out, for CutAgentConnections
}

var _ net.Listener = (*pipeListener)(nil)

func newPipeListener() *pipeListener {
	return &pipeListener{conns: make(chan net.Conn), closed: make(chan struct{})}
}

func (l *pipeListener) dial(ctx context.Context) (net.Conn, error) {
	host, guest := net.Pipe()
	select {
	case l.conns <- guest:
		l.mu.Lock()
		l.hosts = append(l.hosts, host)
		l.mu.Unlock()
		return host, nil
	case <-l.closed:
		return nil, errors.New("fake vm is gone")
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (l *pipeListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.closed:
		return nil, net.ErrClosed
	}
}

func (l *pipeListener) Close() error {
	l.once.Do(func() { close(l.closed) })
	return nil
}

func (l *pipeListener) Addr() net.Addr { return pipeAddr{} }

type pipeAddr struct{}

func (pipeAddr) Network() string { return "pipe" }
func (pipeAddr) String() string  { return "fake-vm" }

// Adopt reports whether the VM is still running.
func (v *VM) Adopt() bool {
	select {
	case <-v.exited:
		return false
	default:
		return true
	}
}
