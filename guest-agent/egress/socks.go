package egress

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"time"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

// SOCKS5 (RFC 1928) as the proxy speaks it: no authentication, CONNECT
// only; domain names, IPv4 and IPv6 addresses.
const (
	socksVersion     = 5
	socksNoAuth      = 0
	socksNoMethod    = 0xff
	socksConnect     = 1
	socksAtypIPv4    = 1
	socksAtypDomain  = 3
	socksAtypIPv6    = 4
	socksSucceeded   = 0
	socksFailure     = 1 // general failure: carreld did not answer
	socksNotAllowed  = 2 // connection not allowed by ruleset: denied
	socksUnreachable = 4 // host unreachable: the name or the dial failed
	socksBadCommand  = 7
	socksBadAddrType = 8
)

// ServeSOCKS5 serves the SOCKS5 proxy on l until ctx ends or accepting
// fails; l is closed when it returns.
func (s *Service) ServeSOCKS5(ctx context.Context, l net.Listener) error {
	return serve(ctx, l, s.serveSOCKSConn)
}

// socksRequest is a program's CONNECT request.
type socksRequest struct {
	host string
	port uint16
}

// socksReply is a reply with a zero bind address, which is all a CONNECT
// client needs.
func socksReply(code byte) []byte {
	return []byte{socksVersion, code, 0, socksAtypIPv4, 0, 0, 0, 0, 0, 0}
}

// readSOCKSRequest runs the greeting and reads the request. It answers
// the client itself for what it refuses, and returns an error then.
func readSOCKSRequest(br *bufio.Reader, w io.Writer) (socksRequest, error) {
	var hdr [2]byte
	if _, err := io.ReadFull(br, hdr[:]); err != nil {
		return socksRequest{}, err
	}
	if hdr[0] != socksVersion {
		return socksRequest{}, fmt.Errorf("SOCKS version %d, want 5", hdr[0])
	}
	methods := make([]byte, hdr[1])
	if _, err := io.ReadFull(br, methods); err != nil {
		return socksRequest{}, err
	}
	ok := false
	for _, m := range methods {
		ok = ok || m == socksNoAuth
	}
	if !ok {
		w.Write([]byte{socksVersion, socksNoMethod})
		return socksRequest{}, errors.New("the client offers no method without authentication")
	}
	if _, err := w.Write([]byte{socksVersion, socksNoAuth}); err != nil {
		return socksRequest{}, err
	}
	var req [4]byte
	if _, err := io.ReadFull(br, req[:]); err != nil {
		return socksRequest{}, err
	}
	if req[0] != socksVersion {
		return socksRequest{}, fmt.Errorf("SOCKS version %d in the request, want 5", req[0])
	}
	var host string
	switch req[3] {
	case socksAtypIPv4, socksAtypIPv6:
		b := make([]byte, 4)
		if req[3] == socksAtypIPv6 {
			b = make([]byte, 16)
		}
		if _, err := io.ReadFull(br, b); err != nil {
			return socksRequest{}, err
		}
		a, _ := netip.AddrFromSlice(b)
		host = a.String()
	case socksAtypDomain:
		n, err := br.ReadByte()
		if err != nil {
			return socksRequest{}, err
		}
		b := make([]byte, n)
		if _, err := io.ReadFull(br, b); err != nil {
			return socksRequest{}, err
		}
		host = string(b)
	default:
		w.Write(socksReply(socksBadAddrType))
		return socksRequest{}, fmt.Errorf("address type %d", req[3])
	}
	var pb [2]byte
	if _, err := io.ReadFull(br, pb[:]); err != nil {
		return socksRequest{}, err
	}
	port := uint16(pb[0])<<8 | uint16(pb[1])
	if req[1] != socksConnect {
		w.Write(socksReply(socksBadCommand))
		return socksRequest{}, fmt.Errorf("command %d: only CONNECT (1) is supported", req[1])
	}
	if err := checkHost(host); err != nil {
		w.Write(socksReply(socksFailure))
		return socksRequest{}, err
	}
	if port == 0 {
		w.Write(socksReply(socksFailure))
		return socksRequest{}, errors.New("port 0")
	}
	return socksRequest{host: host, port: port}, nil
}

func (s *Service) serveSOCKSConn(ctx context.Context, c halfCloser) {
	defer c.Close()
	start := time.Now()
	c.SetDeadline(start.Add(handshakeTimeout))
	br := bufio.NewReaderSize(c, 512)
	req, err := readSOCKSRequest(br, c)
	if err != nil {
		s.opts.Log.Debug("socks5 request refused", "subsystem", "egress", "err", err)
		return
	}
	c.SetDeadline(time.Time{})
	pid := s.opts.PID(c.RemoteAddr().String(), c.LocalAddr().String())
	log := s.opts.Log.With("subsystem", "egress", "proxy", "socks5", "host", req.host, "port", req.port, "pid", pid)
	a, err := s.ask(ctx, req.host, req.port, agentv1.EgressKind_EGRESS_KIND_SOCKS5, pid)
	if err != nil {
		c.Write(socksReply(socksFailure))
		log.Info("egress not answered", "err", err)
		return
	}
	switch a.verdict.Outcome {
	case agentv1.EgressOutcome_EGRESS_OUTCOME_ALLOWED:
	case agentv1.EgressOutcome_EGRESS_OUTCOME_DENIED:
		c.Write(socksReply(socksNotAllowed))
		log.Info("egress denied", "reason", a.verdict.Reason)
		return
	default:
		c.Write(socksReply(socksUnreachable))
		log.Info("egress failed", "reason", a.verdict.Reason)
		return
	}
	if _, err := c.Write(socksReply(socksSucceeded)); err != nil {
		a.tunnel.finish(err)
		return
	}
	up, down, err := pump(a.tunnel, c, br)
	a.tunnel.finish(err)
	log.Debug("egress connection ended", "bytes_up", up, "bytes_down", down, "duration", time.Since(start), "err", err)
}
