package egress

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// refusalLinger bounds the wait for the guest to pass a refusal on.
const refusalLinger = 5 * time.Second

// tlsAccessDenied is a TLS alert record: fatal, access_denied. A program
// whose ClientHello is refused reads it as the server's answer ("remote
// error: tls: access denied") instead of a bare reset.
var tlsAccessDenied = []byte{21, 3, 3, 0, 2, 2, 49}

// guestStream is the host end of a Connect call, as carry uses it.
type guestStream interface {
	Send(*agentv1.EgressData) error
	Receive() (*agentv1.EgressData, error)
	CloseRequest() error
	CloseResponse() error
}

// toGuest serialises what is sent to the guest: data from upstream, and
// the refusal of a ClientHello, come from two goroutines.
type toGuest struct {
	mu     sync.Mutex
	s      guestStream
	closed bool
}

func (t *toGuest) data(b []byte) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return net.ErrClosed
	}
	return t.s.Send(&agentv1.EgressData{Msg: &agentv1.EgressData_Data{Data: b}})
}

func (t *toGuest) isClosed() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.closed
}

// close sends the close, once, and ends the request stream.
func (t *toGuest) close() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return
	}
	t.closed = true
	t.s.Send(&agentv1.EgressData{Msg: &agentv1.EgressData_Close{Close: &agentv1.EgressClose{}}})
	t.s.CloseRequest()
}

// carry answers the guest with an allowed verdict and carries the
// connection until both sides are closed, either breaks, or the VM's
// context or the connection's lifetime ends.
func (c *conn) carry(ctx context.Context, up net.Conn, v *agentv1.EgressVerdict) error {
	c.rec.Outcome = outcomeAllowed
	ctx, cancel := context.WithTimeout(ctx, c.p.cfg.MaxLifetime)
	defer cancel()
	client, done := c.link.Egress()
	bs := client.Connect(ctx)
	defer bs.CloseResponse()
	// Cancelling alone does not wake a Receive while the request body is
	// open; closing the response does (as in the port relay).
	stop := context.AfterFunc(ctx, func() { bs.CloseResponse(); up.Close() })
	defer stop()
	if err := bs.Send(&agentv1.EgressData{Msg: &agentv1.EgressData_Verdict{Verdict: v}}); err != nil {
		if _, err := bs.Receive(); err != nil {
			return c.guestErr(done(ctx, err))
		}
		return err
	}
	return c.relay(ctx, cancel, bs, up, done)
}

// relay carries bytes both ways; split from carry for tests.
func (c *conn) relay(ctx context.Context, cancel context.CancelFunc, bs guestStream, up net.Conn, done func(context.Context, error) error) error {
	g := &toGuest{s: bs}
	downErr := make(chan error, 1)
	go func() {
		err := c.copyDown(ctx, up, g)
		if err != nil {
			cancel() // the upstream broke: end the guest's side too
		}
		downErr <- err
	}()
	err := c.copyUp(ctx, bs, up, g)
	var r *refusal
	if errors.As(err, &r) {
		// Let the guest pass the alert on before the call ends: ending it
		// now would close the program's connection under the alert.
		up.Close()
		linger := time.AfterFunc(refusalLinger, cancel)
		for {
			if _, rerr := bs.Receive(); rerr != nil {
				break
			}
		}
		linger.Stop()
	}
	if err != nil {
		cancel()
		up.Close()
		derr := <-downErr
		var ge *guestError
		switch {
		case errors.As(err, &r), errors.As(err, &ge):
			return err
		case derr != nil:
			return derr // the upstream broke first, and that ended the call
		}
		return c.guestErr(done(ctx, err))
	}
	// The guest ended its call: it has sent its close and had ours.
	select {
	case err := <-downErr:
		return err
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// copyDown carries upstream's bytes to the guest, then its close. A read
// error other than EOF ends the connection.
func (c *conn) copyDown(ctx context.Context, up net.Conn, g *toGuest) error {
	buf := make([]byte, chunkBytes)
	for {
		// Under a bandwidth limit, read about an eighth of a second's
		// worth at a time, so that the bytes flow rather than lurch.
		size := len(buf)
		if rate := c.v.down.limit(); rate > 0 {
			size = int(min(float64(size), max(rate/8, 1024)))
		}
		n, rerr := up.Read(buf[:size])
		if n > 0 {
			if err := c.v.down.take(ctx, n); err != nil {
				return err
			}
			if err := g.data(buf[:n]); err != nil {
				return nil // the call is ending; the other side says why
			}
			c.down.Add(int64(n))
		}
		if errors.Is(rerr, io.EOF) {
			g.close()
			return nil
		}
		if rerr != nil {
			if ctx.Err() != nil || g.isClosed() {
				return nil // ended here: the other side says why
			}
			return fmt.Errorf("read from %s: %w", c.rec.IP, rerr)
		}
	}
}

// copyUp carries the guest's bytes upstream until the guest ends its
// call. It checks the shape of what the guest sends, and holds the first
// bytes until they are known not to be a ClientHello for another name:
// for every kind of request, since the kind is the guest's word (a plain
// http request's first bytes are not TLS, and pass at once).
func (c *conn) copyUp(ctx context.Context, bs guestStream, up net.Conn, g *toGuest) error {
	gate := true
	var held []byte
	closed := false
	for {
		msg, err := bs.Receive()
		if errors.Is(err, io.EOF) {
			if !closed {
				return errGuest("ended the connection without a close")
			}
			return nil
		}
		if err != nil {
			return err
		}
		switch m := msg.Msg.(type) {
		case *agentv1.EgressData_Data:
			if closed {
				return errGuest("data after close")
			}
			if len(m.Data) > maxChunk {
				return errGuest("a %d-byte chunk, over the %d-byte cap", len(m.Data), maxChunk)
			}
			b := m.Data
			if gate {
				held = append(held, b...)
				out, done, err := c.checkFirstBytes(held, g)
				if err != nil {
					return err
				}
				if !done {
					continue
				}
				gate, b, held = false, out, nil
			}
			if err := c.v.up.take(ctx, len(b)); err != nil {
				return err
			}
			if _, err := up.Write(b); err != nil {
				return fmt.Errorf("write to %s: %w", c.rec.IP, err)
			}
			c.up.Add(int64(len(b)))
		case *agentv1.EgressData_Close:
			if closed {
				return errGuest("a second close")
			}
			if gate && len(held) > 0 {
				if _, err := ParseClientHello(held); errors.Is(err, ErrNotTLS) {
					return c.refuseHTTP(g, "the connection closed in the middle of an HTTP request's head")
				}
				return c.refuseHello(g, "the tunnel closed in the middle of a TLS ClientHello")
			}
			closed = true
			if hc, ok := up.(interface{ CloseWrite() error }); ok {
				hc.CloseWrite()
			}
		default:
			return errGuest("unexpected message %T", msg.Msg)
		}
	}
}

// checkFirstBytes checks the first bytes of a connection, held until they
// are known: a TLS ClientHello's server name, or a plain HTTP request's
// Host. It returns what to send upstream once done; not done means more
// bytes are needed. A plain-HTTP connection (the proxy's "http" kind)
// must carry an HTTP request; another kind may carry any protocol.
func (c *conn) checkFirstBytes(held []byte, g *toGuest) (out []byte, done bool, err error) {
	h, err := ParseClientHello(held)
	switch {
	case errors.Is(err, ErrNeedMore):
		return nil, false, nil
	case errors.Is(err, ErrNotTLS):
	case err != nil:
		return nil, false, c.refuseHello(g, fmt.Sprintf("the tunnel's first bytes are TLS but not a well-formed ClientHello: %v", err))
	default:
		c.rec.SNI = protocol.CleanText(h.ServerName, 255)
		if why := c.checkSNI(h); why != "" {
			return nil, false, c.refuseHello(g, why)
		}
		return held, true, nil
	}
	head, err := ParseRequestHead(held)
	switch {
	case errors.Is(err, ErrHeadNeedMore):
		return nil, false, nil
	case errors.Is(err, ErrNotHTTP):
		if c.req.Kind == agentv1.EgressKind_EGRESS_KIND_HTTP {
			return nil, false, c.refuseHTTP(g, "a plain-HTTP connection whose first bytes are not an HTTP/1.x request")
		}
		return held, true, nil
	case err != nil:
		return nil, false, c.refuseHTTP(g, err.Error())
	}
	c.rec.HTTPHost = protocol.CleanText(head.Hosts0(), 255)
	if why := checkHead(head, c.rec.Host, c.rec.Port); why != "" {
		return nil, false, c.refuseHTTP(g, why)
	}
	return append(closeHead(head), held[head.Len:]...), true, nil
}

// refuseHTTP answers a refused HTTP request with 403 and a close, before
// anything of it went upstream.
func (c *conn) refuseHTTP(g *toGuest, why string) error {
	g.data(httpForbidden(why))
	g.close()
	return &refusal{msg: why}
}

// checkSNI returns why h may not go to the host decided on, or "".
func (c *conn) checkSNI(h ClientHello) string {
	sni := strings.TrimSuffix(strings.ToLower(h.ServerName), ".")
	if _, err := netip.ParseAddr(c.rec.Host); err == nil {
		// RFC 6066: no IP addresses in server_name; a name is another host.
		if sni != "" {
			return fmt.Sprintf("TLS server name %q in a tunnel to the address %s", sni, c.rec.Host)
		}
		return ""
	}
	switch {
	case sni == "" && h.ECH:
		return fmt.Sprintf("a TLS ClientHello with encrypted_client_hello and no server name in a tunnel to %s", c.rec.Host)
	case sni == "":
		return fmt.Sprintf("a TLS ClientHello without a server name in a tunnel to %s", c.rec.Host)
	case sni != c.rec.Host:
		return fmt.Sprintf("TLS server name %q does not match the tunnel's host %s", sni, c.rec.Host)
	}
	return ""
}

// refuseHello answers a refused ClientHello with a TLS alert and a close,
// before anything of it went upstream.
func (c *conn) refuseHello(g *toGuest, why string) error {
	g.data(tlsAccessDenied)
	g.close()
	return &refusal{msg: why}
}

var _ guestStream = (*connect.BidiStreamForClient[agentv1.EgressData, agentv1.EgressData])(nil)
