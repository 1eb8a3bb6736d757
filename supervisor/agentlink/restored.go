package agentlink

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"time"
)

// HTTP/2 facts (RFC 9113) the takeover reads frames by.
const (
	frameHeaderLen  = 9
	frameGoAway     = 0x7
	maxTakeoverRead = 1 << 20 // the agent's largest frame
)

// oversized is the header of a frame 16 MiB long: over the agent's frame
// size limit, so a session reading it fails at once, having read exactly
// these 9 bytes.
var oversized = []byte{0xff, 0xff, 0xff, 0, 0, 0, 0, 0, 0}

// errNoTakeover: the agent's old session did not end in time.
var errNoTakeover = errors.New("the guest agent's old session did not end")

// TakeOver ends the old session of an agent restored from a snapshot,
// before the link's first call. Such an agent still holds the HTTP/2
// session it had when the state was saved, and would read the host's
// handshake as that session's frames: it answers GOAWAY, then goes on
// reading, and discarding, whatever comes for its shutdown's second, so
// the next handshakes are lost too. So TakeOver connects and sends only
// the header of an oversized frame: the old session fails on exactly those
// bytes and answers GOAWAY. TakeOver then hangs up, which the old session
// reads as the end of its connection at once; the agent opens its port
// anew and waits for the next host, whose first bytes start a fresh
// session. settle is how long the guest gets to see the hang-up. It gives
// up after timeout; the link's readiness probes then get past the old
// session as they can.
func (l *Link) TakeOver(ctx context.Context, timeout, settle time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	c, err := l.dial(ctx)
	if err != nil {
		return err
	}
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(dl)
	}
	err = endOldSession(c)
	c.Close()
	if err != nil {
		return err
	}
	select {
	case <-ctx.Done():
	case <-time.After(settle):
	}
	return nil
}

// endOldSession sends the oversized header on c and reads the old
// session's frames up to its GOAWAY.
func endOldSession(c net.Conn) error {
	if _, err := c.Write(oversized); err != nil {
		return err
	}
	var hdr [frameHeaderLen]byte
	for {
		if _, err := io.ReadFull(c, hdr[:]); err != nil {
			return fmt.Errorf("%w: %w", errNoTakeover, err)
		}
		n := int(hdr[0])<<16 | int(hdr[1])<<8 | int(hdr[2])
		if n > maxTakeoverRead {
			return fmt.Errorf("%w: a frame of %d bytes", errNoTakeover, n)
		}
		if _, err := io.CopyN(io.Discard, c, int64(n)); err != nil {
			return fmt.Errorf("%w: %w", errNoTakeover, err)
		}
		if hdr[3] == frameGoAway {
			return nil
		}
	}
}
