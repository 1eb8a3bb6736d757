// Package egress is the guest's way out: carrel-agent's HTTP proxy
// (CONNECT, and plain http:// requests in absolute form) and SOCKS5 proxy
// (CONNECT) on the guest's loopback, tunnelled to carreld.
//
// The VM has no network interface, so these proxies are the only way out,
// and they decide nothing: each connection a program asks for becomes an
// EgressDialRequest on the Requests stream carreld holds open, and waits
// for carreld's Connect call that answers it. An allowed connection's bytes
// then travel in that call; a denied or failed one gets an explicit error
// (HTTP 403 or 502, SOCKS5 reply 2 or 4); a request carreld does not answer
// within Options.Timeout gets 504 (SOCKS5 reply 1). Nothing hangs.
package egress

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
)

const (
	// HTTPProxyAddr and SOCKSProxyAddr are where carrel-agent's proxies
	// listen in the guest.
	HTTPProxyAddr  = "127.0.0.1:3128"
	SOCKSProxyAddr = "127.0.0.1:1080"
	// DefaultTimeout bounds the wait for carreld's verdict.
	DefaultTimeout = 10 * time.Second
	// ChunkBytes is the most bytes one data message from the agent
	// carries: large, since under TCG each message costs more than its
	// bytes.
	ChunkBytes = 256 << 10
	// MaxWaiting caps the requests waiting for carreld's verdict; a
	// program asking beyond it is refused at once (503, SOCKS5 reply 1).
	MaxWaiting = 256
	// handshakeTimeout bounds a program's proxy request (its header, its
	// SOCKS5 greeting), and maxHeaderBytes its size.
	handshakeTimeout = 30 * time.Second
	maxHeaderBytes   = 64 << 10
)

// Env is the environment that points a command's programs at the proxies.
// NO_PROXY keeps the guest's own loopback services direct.
func Env() []string {
	h, s := "http://"+HTTPProxyAddr, "socks5h://"+SOCKSProxyAddr
	const no = "localhost,127.0.0.1,::1"
	return []string{
		"HTTP_PROXY=" + h, "HTTPS_PROXY=" + h, "ALL_PROXY=" + s, "NO_PROXY=" + no,
		"http_proxy=" + h, "https_proxy=" + h, "all_proxy=" + s, "no_proxy=" + no,
	}
}

// Options configures a Service. Zero fields take the defaults.
type Options struct {
	// Timeout bounds how long a connection waits for carreld's verdict.
	Timeout time.Duration
	// PID names the process of a proxy client, from its connection; nil
	// means PeerPID (from /proc). It returns 0 when it cannot tell.
	PID func(client, proxy string) int32
	// Log receives one record per connection; nil means slog.Default().
	Log *slog.Logger
}

// Errors a proxy reports to its client without carreld's say.
var (
	// ErrTimeout: carreld did not answer within Options.Timeout.
	ErrTimeout = errors.New("carreld did not answer the connection request in time")
	// ErrBusy: MaxWaiting requests are waiting already.
	ErrBusy = errors.New("too many connection requests waiting for carreld")
)

// Service is the agent's EgressService, and the proxies that feed it.
type Service struct {
	opts Options
	// ready has a token when queued may hold a request to send.
	ready chan struct{}

	mu      sync.Mutex
	waiting map[uint64]*request // queued, or sent and not yet answered
	queued  []uint64            // not yet sent, oldest first
	nextID  uint64
}

var _ agentv1connect.EgressServiceHandler = (*Service)(nil)

// New returns a Service.
func New(opts Options) *Service {
	if opts.Timeout <= 0 {
		opts.Timeout = DefaultTimeout
	}
	if opts.PID == nil {
		opts.PID = PeerPID
	}
	if opts.Log == nil {
		opts.Log = slog.Default()
	}
	return &Service{opts: opts, ready: make(chan struct{}, 1), waiting: map[uint64]*request{}}
}

// request is one connection waiting for carreld's verdict.
type request struct {
	msg    *agentv1.EgressDialRequest
	answer chan answer // one answer, from Connect
}

// answer is carreld's verdict, and for an allowed connection the tunnel.
type answer struct {
	verdict *agentv1.EgressVerdict
	tunnel  *tunnel
}

// tunnel is an allowed connection's Connect call, lent by its handler to
// the proxy until the proxy sends its result on done.
type tunnel struct {
	ctx    context.Context
	stream dataStream
	done   chan error
}

// dataStream is the part of the Connect stream a tunnel uses; tests fake it.
type dataStream interface {
	Receive() (*agentv1.EgressData, error)
	Send(*agentv1.EgressData) error
}

// ask queues a request for a connection and waits for carreld's answer.
// For an allowed connection the caller must send the tunnel's result on
// its done channel once it no longer uses the stream.
func (s *Service) ask(ctx context.Context, host string, port uint16, kind agentv1.EgressKind, pid int32) (answer, error) {
	r := &request{answer: make(chan answer, 1)}
	s.mu.Lock()
	if len(s.waiting) >= MaxWaiting {
		s.mu.Unlock()
		return answer{}, ErrBusy
	}
	s.nextID++
	r.msg = &agentv1.EgressDialRequest{Id: s.nextID, Host: host, Port: uint32(port), Kind: kind, Pid: pid}
	s.waiting[r.msg.Id] = r
	s.queued = append(s.queued, r.msg.Id)
	s.mu.Unlock()
	s.signal()

	t := time.NewTimer(s.opts.Timeout)
	defer t.Stop()
	select {
	case a := <-r.answer:
		return a, nil
	case <-t.C:
	case <-ctx.Done():
	}
	if s.take(r.msg.Id) != nil {
		return answer{}, ErrTimeout
	}
	// Connect took it first: its answer is on its way.
	return <-r.answer, nil
}

// take removes the request id from the waiting ones and returns it, or nil
// when it is not waiting (answered, or given up on).
func (s *Service) take(id uint64) *request {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.waiting[id]
	delete(s.waiting, id)
	return r
}

func (s *Service) signal() {
	select {
	case s.ready <- struct{}{}:
	default:
	}
}

// next pops the oldest queued request still waiting, or returns nil.
func (s *Service) next() *request {
	s.mu.Lock()
	defer s.mu.Unlock()
	for len(s.queued) > 0 {
		id := s.queued[0]
		s.queued = s.queued[1:]
		if r := s.waiting[id]; r != nil {
			return r
		}
	}
	s.queued = nil // let the array go
	return nil
}

// unsend puts r back at the head of the queue.
func (s *Service) unsend(r *request) {
	s.mu.Lock()
	s.queued = append([]uint64{r.msg.Id}, s.queued...)
	s.mu.Unlock()
	s.signal()
}

// Requests implements agentv1connect.EgressServiceHandler: it sends each
// request as it comes until the call ends. A request that could not be
// sent goes back to the queue for the next call.
func (s *Service) Requests(ctx context.Context, _ *connect.Request[agentv1.EgressRequestsRequest], stream *connect.ServerStream[agentv1.EgressDialRequest]) error {
	for {
		r := s.next()
		if r == nil {
			select {
			case <-ctx.Done():
				return nil
			case <-s.ready:
				continue
			}
		}
		if err := stream.Send(r.msg); err != nil {
			s.unsend(r)
			return err
		}
	}
}

// Connect implements agentv1connect.EgressServiceHandler. Its errors are
// *connect.Error: InvalidArgument when the first message is not a
// verdict, NotFound for an id no request waits under.
func (s *Service) Connect(ctx context.Context, stream *connect.BidiStream[agentv1.EgressData, agentv1.EgressData]) error {
	first, err := stream.Receive()
	if err != nil {
		return err
	}
	v := first.GetVerdict()
	if v == nil {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("egress connect: the first message must be a verdict, not %T", first.Msg))
	}
	r := s.take(v.Id)
	if r == nil {
		return connect.NewError(connect.CodeNotFound, fmt.Errorf("egress connect: no request %d is waiting (answered, or given up on)", v.Id))
	}
	if v.Outcome != agentv1.EgressOutcome_EGRESS_OUTCOME_ALLOWED {
		r.answer <- answer{verdict: v}
		return nil
	}
	t := &tunnel{ctx: ctx, stream: stream, done: make(chan error, 1)}
	r.answer <- answer{verdict: v, tunnel: t}
	// The stream lives only as long as this call: wait for the proxy to
	// finish with it. The proxy ends its use when ctx ends.
	return <-t.done
}
