// Package egress is carreld's egress proxy: the only way out of a VM.
//
// A VM has no network interface. Programs in it use carrel-agent's HTTP and
// SOCKS5 proxies (guest-agent/egress), and the agent pushes each
// connection they ask for on an EgressService.Requests stream that Serve
// holds open while the VM runs. For each request carreld:
//
//   - decides the name and port with the VM's current policy (carrel.net,
//     direction egress) before it resolves anything, so that a denied name
//     never reaches DNS;
//   - resolves the name itself (Config.Resolver), and decides again with
//     the addresses and their classes: private, loopback, link-local,
//     CGNAT, multicast, metadata and other non-public addresses are
//     refused unless the policy names them, and an IP literal is refused
//     unless an entry names it exactly;
//   - enforces the VM's limits (settings.net.limits): connections open at
//     once, and bytes a second each way;
//   - dials exactly an address it decided on (no second lookup);
//   - answers with a Connect call whose first message is the verdict, and
//     carries the bytes; the first bytes of a CONNECT or SOCKS5 tunnel are
//     held until, if they are a TLS ClientHello, its server name is found
//     to be the host decided on;
//   - writes one net.egress audit record per request, allowed or not.
//
// The guest is hostile: its requests are rate-limited and capped in
// number, every field is checked before use, its data messages are
// size-capped, and a guest that breaks the protocol loses the connection.
package egress

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/recorder"
)

// Recorder is where the records go: *audit.Log.
type Recorder interface {
	Append(ctx context.Context, rec audit.Record) (uint64, error)
}

// Link gives the guest's egress service on the agent's current
// connection, and the function every error of a call made with it must be
// passed to: *agentlink.Link.
type Link interface {
	Egress() (agentv1connect.EgressServiceClient, func(context.Context, error) error)
}

// Policies decides (and records the decision) with a named policy:
// *policystore.Store.
type Policies interface {
	Decide(ctx context.Context, name string, in policy.Input) (policy.Decision, error)
	Get(name string) (*policy.Policy, error)
}

// Defaults for Config, and fixed caps.
const (
	DefaultResolveTimeout = 3 * time.Second
	// DefaultDialTimeout bounds the dial of all of a name's addresses
	// together. With the resolve it stays within the agent's 10 s wait.
	DefaultDialTimeout = 5 * time.Second
	// DefaultMaxLifetime bounds one connection.
	DefaultMaxLifetime = 24 * time.Hour
	// DefaultAttemptRate is the requests a second a VM may make, averaged
	// over a second; more wait (the agent's own timeout then fails them).
	DefaultAttemptRate = 100
	// MaxOpen caps a VM's requests in hand and connections open, whatever
	// its policy's limits say; more wait.
	MaxOpen = 512
	// MaxAddresses is how many of a name's addresses are decided on and
	// tried.
	MaxAddresses = 16

	// Data messages are large: under TCG each message costs the guest far
	// more than its bytes do (as carrel's file uploads found).
	maxChunk       = 256 << 10 // one data message from the guest
	chunkBytes     = 256 << 10 // one data message to the guest
	streamLifetime = time.Hour
	minBackoff     = time.Second
	maxBackoff     = 30 * time.Second
	// minBurst is the least burst of a bandwidth limit.
	minBurst = 32 << 10
	// denyWait bounds the wait for the guest to end a refused call.
	denyWait = 10 * time.Second
)

// Config configures a Proxy. Policies is required; zero fields take the
// defaults.
type Config struct {
	Policies Policies
	// Audit gets one net.egress record per request; nil records none.
	Audit Recorder
	// Resolver resolves names; nil means net.DefaultResolver.
	Resolver Resolver
	// Dial dials an address ("ip:port"); nil means a net.Dialer.
	Dial           func(ctx context.Context, network, address string) (net.Conn, error)
	ResolveTimeout time.Duration
	DialTimeout    time.Duration
	MaxLifetime    time.Duration
	AttemptRate    float64
	Log            *slog.Logger
}

// Proxy serves the egress of every VM of one carreld.
type Proxy struct {
	cfg Config

	mu  sync.Mutex
	vms map[string]*vmState
}

// vmState is what a VM's connections share.
type vmState struct {
	refs     int // Serve calls for the VM
	open     atomic.Int64
	inHand   chan struct{} // MaxOpen slots
	up, down *bucket       // bandwidth, each way
	attempts *bucket
}

// New returns a Proxy.
func New(cfg Config) *Proxy {
	if cfg.Resolver == nil {
		cfg.Resolver = net.DefaultResolver
	}
	if cfg.Dial == nil {
		var d net.Dialer
		cfg.Dial = d.DialContext
	}
	if cfg.ResolveTimeout <= 0 {
		cfg.ResolveTimeout = DefaultResolveTimeout
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = DefaultDialTimeout
	}
	if cfg.MaxLifetime <= 0 {
		cfg.MaxLifetime = DefaultMaxLifetime
	}
	if cfg.AttemptRate <= 0 {
		cfg.AttemptRate = DefaultAttemptRate
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	return &Proxy{cfg: cfg, vms: map[string]*vmState{}}
}

func (p *Proxy) acquire(vm string) *vmState {
	p.mu.Lock()
	defer p.mu.Unlock()
	v := p.vms[vm]
	if v == nil {
		v = &vmState{inHand: make(chan struct{}, MaxOpen), up: newBucket(), down: newBucket(), attempts: newBucket()}
		v.attempts.setRate(p.cfg.AttemptRate, p.cfg.AttemptRate)
		p.vms[vm] = v
	}
	v.refs++
	return v
}

func (p *Proxy) release(vm string, v *vmState) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if v.refs--; v.refs == 0 && p.vms[vm] == v {
		delete(p.vms, vm)
	}
}

// VM is a live VM whose egress a Proxy serves.
type VM struct {
	Name string
	// Session names its run, for the records.
	Session string
	// Policy names the policy it is bound to now.
	Policy func() string
}

// ErrUnsupported is returned by Serve when the guest agent does not serve
// EgressService (an older agent): the VM then has no egress at all.
var ErrUnsupported = errors.New("the guest agent does not serve egress")

// Serve carries vm's egress until ctx ends (it returns nil) or the guest
// has no egress service (ErrUnsupported). It holds the Requests stream
// open, reopening it after a backoff when it breaks, and returns only once
// every connection it started has ended and been recorded.
func (p *Proxy) Serve(ctx context.Context, link Link, vm VM) error {
	v := p.acquire(vm.Name)
	defer p.release(vm.Name, v)
	var conns sync.WaitGroup
	defer conns.Wait()
	log := p.cfg.Log.With("subsystem", "egress", "vm", vm.Name)
	backoff := minBackoff
	for ctx.Err() == nil {
		progress, err := p.stream(ctx, link, v, vm, &conns)
		switch {
		case ctx.Err() != nil:
			return nil
		case connect.CodeOf(err) == connect.CodeUnimplemented:
			log.Warn("the guest agent does not serve egress: the VM has no network", "err", err)
			return fmt.Errorf("%w: %w", ErrUnsupported, err)
		case errors.Is(err, errLifetime):
			backoff = minBackoff
			continue
		}
		if progress {
			backoff = minBackoff
		}
		log.Debug("egress request stream ended; reopening", "err", err, "in", backoff)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, maxBackoff)
	}
	return nil
}

var errLifetime = errors.New("egress request stream reached its lifetime")

// stream holds one Requests stream open and starts a connection for each
// request, until the stream ends. progress says whether a request came.
func (p *Proxy) stream(ctx context.Context, link Link, v *vmState, vm VM, conns *sync.WaitGroup) (progress bool, err error) {
	client, done := link.Egress()
	sctx, cancel := context.WithTimeoutCause(ctx, streamLifetime, errLifetime)
	defer cancel()
	s, err := client.Requests(sctx, connect.NewRequest(&agentv1.EgressRequestsRequest{}))
	if err != nil {
		return false, done(ctx, err)
	}
	defer s.Close()
	for s.Receive() {
		progress = true
		req := s.Msg()
		if err := v.attempts.take(ctx, 1); err != nil {
			return progress, err
		}
		select {
		case v.inHand <- struct{}{}:
		case <-ctx.Done():
			return progress, ctx.Err()
		}
		conns.Go(func() {
			defer func() { <-v.inHand }()
			c := &conn{p: p, link: link, v: v, vm: vm.Name, session: vm.Session, policy: vm.Policy, req: req, start: time.Now()}
			c.run(ctx)
		})
	}
	err = s.Err()
	if context.Cause(sctx) == errLifetime && ctx.Err() == nil {
		return progress, errLifetime
	}
	return progress, done(ctx, err)
}

// kindNames are the request kinds as records name them.
var kindNames = map[agentv1.EgressKind]string{
	agentv1.EgressKind_EGRESS_KIND_HTTP_CONNECT: "http-connect",
	agentv1.EgressKind_EGRESS_KIND_HTTP:         "http",
	agentv1.EgressKind_EGRESS_KIND_SOCKS5:       "socks5",
}

// Outcomes of a request, as records name them.
const (
	outcomeAllowed = "allowed" // carried; an error says how it ended badly
	outcomeDenied  = "denied"  // the policy, a limit, or the TLS check refused it
	outcomeFailed  = "failed"  // allowed, but it did not resolve or connect
)

// conn is one request, from its decision to the end of its connection.
type conn struct {
	p       *Proxy
	link    Link
	v       *vmState
	vm      string
	session string
	policy  func() string
	req     *agentv1.EgressDialRequest
	start   time.Time
	rec     audit.Egress
	counted bool // it holds one of v.open

	up, down atomic.Int64
}

// refusal is an error that makes the outcome a deny.
type refusal struct{ msg string }

func (r *refusal) Error() string { return r.msg }

// run decides, connects, answers the guest, carries the bytes and
// records the outcome.
func (c *conn) run(ctx context.Context) {
	c.rec = audit.Egress{ID: c.req.Id, PID: max(0, c.req.Pid), Host: protocol.CleanText(c.req.Host, 255), Port: c.req.Port,
		Protocol: kindNames[c.req.Kind], Outcome: outcomeDenied}
	if c.rec.Protocol == "" {
		c.rec.Protocol = fmt.Sprintf("unknown (%d)", c.req.Kind)
	}
	up, verdict := c.admit(ctx)
	if c.counted {
		defer c.v.open.Add(-1)
	}
	var err error
	if up != nil {
		defer up.Close()
		err = c.carry(ctx, up, verdict)
	} else {
		err = c.refuse(ctx, verdict)
	}
	c.rec.BytesUp, c.rec.BytesDown = c.up.Load(), c.down.Load()
	if err != nil {
		if r, ok := errors.AsType[*refusal](err); ok {
			c.rec.Outcome, c.rec.Error = outcomeDenied, r.msg
		} else if c.rec.Error == "" {
			c.rec.Error = protocol.CleanText(err.Error(), 1024)
		}
	}
	c.write(ctx)
}

// admit decides the request and, when it is allowed, dials. It returns the
// upstream connection, or nil and the verdict that refuses it.
func (c *conn) admit(ctx context.Context) (net.Conn, *agentv1.EgressVerdict) {
	refuse := func(outcome agentv1.EgressOutcome, err error) (net.Conn, *agentv1.EgressVerdict) {
		c.rec.Outcome = outcomeDenied
		if outcome == agentv1.EgressOutcome_EGRESS_OUTCOME_FAILED {
			c.rec.Outcome = outcomeFailed
		}
		c.rec.Error = protocol.CleanText(err.Error(), 1024)
		return nil, &agentv1.EgressVerdict{Id: c.req.Id, Outcome: outcome, Reason: c.rec.Error}
	}
	denied, failed := agentv1.EgressOutcome_EGRESS_OUTCOME_DENIED, agentv1.EgressOutcome_EGRESS_OUTCOME_FAILED
	if _, ok := kindNames[c.req.Kind]; !ok {
		return refuse(denied, fmt.Errorf("unknown request kind %d", c.req.Kind))
	}
	in := &policy.NetInput{VM: c.vm, Direction: policy.DirEgress, Host: c.req.Host, Port: int(min(c.req.Port, 1<<20)), Protocol: "tcp"}
	if err := c.decide(ctx, in); err != nil {
		return refuse(denied, err)
	}
	host, port := in.Host, uint16(in.Port)
	c.rec.Host = host
	addrs := make([]netip.Addr, 0, 1)
	if in.IPLiteral {
		addrs = append(addrs, netip.MustParseAddr(in.Addresses[0].IP))
	} else {
		rctx, cancel := context.WithTimeout(ctx, c.p.cfg.ResolveTimeout)
		found, err := c.p.cfg.Resolver.LookupNetIP(rctx, "ip", host)
		cancel()
		if err != nil {
			return refuse(failed, fmt.Errorf("resolve %s: %w", host, err))
		}
		seen := map[netip.Addr]bool{}
		for _, a := range found {
			a = a.Unmap()
			if a.IsValid() && a.Zone() == "" && !seen[a] && len(addrs) < MaxAddresses {
				seen[a] = true
				addrs = append(addrs, a)
			}
		}
		if len(addrs) == 0 {
			return refuse(failed, fmt.Errorf("resolve %s: no addresses", host))
		}
		in2 := &policy.NetInput{VM: c.vm, Direction: policy.DirEgress, Host: host, Port: int(port), Protocol: "tcp"}
		for _, a := range addrs {
			in2.Addresses = append(in2.Addresses, policy.NetAddress{IP: a.String()})
		}
		if err := c.decide(ctx, in2); err != nil {
			c.rec.Addresses = addrStrings(addrs)
			return refuse(denied, err)
		}
	}
	c.rec.Addresses = addrStrings(addrs)

	limits, err := c.limits(ctx)
	if err != nil {
		return refuse(denied, err)
	}
	c.v.up.setRate(float64(limits.BandwidthBytesPerSecond), minBurst)
	c.v.down.setRate(float64(limits.BandwidthBytesPerSecond), minBurst)
	n := c.v.open.Add(1)
	c.counted = true
	if limits.MaxConnections > 0 && n > limits.MaxConnections {
		return refuse(denied, fmt.Errorf("carrel.net.limits: %d egress connections open, settings.net.limits.max_connections is %d", n-1, limits.MaxConnections))
	}

	dctx, cancel := context.WithTimeout(ctx, c.p.cfg.DialTimeout)
	defer cancel()
	var errs []error
	for _, a := range addrs {
		up, err := c.p.cfg.Dial(dctx, "tcp", netip.AddrPortFrom(a, port).String())
		if err == nil {
			c.rec.IP = a.String()
			return up, &agentv1.EgressVerdict{Id: c.req.Id, Outcome: agentv1.EgressOutcome_EGRESS_OUTCOME_ALLOWED}
		}
		errs = append(errs, err)
		if dctx.Err() != nil {
			break
		}
	}
	return refuse(failed, fmt.Errorf("connect to %s port %d: %w", host, port, errors.Join(errs...)))
}

// decide asks the VM's policy about in, keeping the decision's id and
// rule for the record. A deny, or a failure to decide, is an error.
func (c *conn) decide(ctx context.Context, in *policy.NetInput) error {
	// The decision is recorded in the VM's session.
	d, err := c.p.cfg.Policies.Decide(recorder.WithSession(ctx, c.vm, c.session), c.policy(), in)
	if d.ID != "" {
		c.rec.Decisions = append(c.rec.Decisions, d.ID)
	}
	c.rec.Rule = d.Rule
	if err == nil && !d.Allow {
		err = errors.New("denied")
	}
	if err != nil {
		return fmt.Errorf("policy %s, rule %s: %s [decision %s]", d.Policy, d.Rule, d.Reason, d.ID)
	}
	return nil
}

// limits are the VM's policy's net limits now.
func (c *conn) limits(ctx context.Context) (policy.NetLimits, error) {
	pol, err := c.p.cfg.Policies.Get(c.policy())
	if err != nil {
		return policy.NetLimits{}, err
	}
	return pol.NetLimits(ctx, c.vm)
}

func addrStrings(addrs []netip.Addr) []string {
	s := make([]string, len(addrs))
	for i, a := range addrs {
		s[i] = a.String()
	}
	return s
}

// refuse answers the guest with a deny or a failure, and waits (a while)
// for it to end the call.
func (c *conn) refuse(ctx context.Context, v *agentv1.EgressVerdict) error {
	ctx, cancel := context.WithTimeout(ctx, denyWait)
	defer cancel()
	client, done := c.link.Egress()
	bs := client.Connect(ctx)
	defer bs.CloseResponse()
	// A failed send shows up in Receive.
	_ = bs.Send(&agentv1.EgressData{Msg: &agentv1.EgressData_Verdict{Verdict: v}})
	bs.CloseRequest()
	if msg, err := bs.Receive(); err == nil {
		return errGuest("sent %T after a refusal", msg.Msg)
	} else if !errors.Is(err, io.EOF) {
		return c.guestErr(done(ctx, err))
	}
	return nil
}

// guestErr says what a Connect call's error means for the record.
func (c *conn) guestErr(err error) error {
	if connect.CodeOf(err) == connect.CodeNotFound {
		return errors.New("the guest gave up on the request before carreld answered")
	}
	return err
}

// write records the request.
func (c *conn) write(ctx context.Context) {
	c.rec.DurationNs = time.Since(c.start).Nanoseconds()
	log := c.p.cfg.Log.With("subsystem", "egress", "vm", c.vm, "host", c.rec.Host, "port", c.rec.Port, "protocol", c.rec.Protocol,
		"outcome", c.rec.Outcome, "ip", c.rec.IP, "bytes_up", c.rec.BytesUp, "bytes_down", c.rec.BytesDown, "err", c.rec.Error)
	if c.rec.Outcome == outcomeAllowed {
		log.Debug("egress connection")
	} else {
		log.Info("egress refused")
	}
	if c.p.cfg.Audit == nil {
		return
	}
	data, err := json.Marshal(c.rec)
	if err != nil {
		return
	}
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	if _, err := c.p.cfg.Audit.Append(actx, audit.Record{Kind: audit.KindNetEgress, VM: c.vm, Session: c.session, Provenance: audit.Host, Data: data}); err != nil {
		c.p.cfg.Log.Error("egress connection not recorded", "vm", c.vm, "host", c.rec.Host, "err", err)
	}
}

// guestError is a guest that broke the protocol: its call ends, and the
// link stays (as in the port relay).
type guestError struct{ msg string }

func (e *guestError) Error() string { return "guest broke the egress protocol: " + e.msg }

func errGuest(format string, args ...any) error {
	return &guestError{msg: fmt.Sprintf(format, args...)}
}
