package activity

import (
	"encoding/json"
	"fmt"
	"path"
	"strings"
	"unicode/utf8"

	"google.golang.org/protobuf/proto"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/audit"
)

// Caps on what a guest may send.
const (
	// MaxEvents is the most events one message may carry, and
	// MaxMessageBytes its most bytes (the link's own cap,
	// protocol.MaxMessageBytes, is larger); a message over either breaks
	// the protocol and ends the stream.
	MaxEvents       = 256
	MaxMessageBytes = 512 << 10
	// MaxPathBytes is the longest path an event may name.
	MaxPathBytes = 4096
	// maxAgeNs bounds an event's age: a day.
	maxAgeNs = 24 * 3600 * 1e9
)

// ops names the operations in records.
var ops = map[agentv1.ActivityOp]string{
	agentv1.ActivityOp_ACTIVITY_OP_OPEN:      "open",
	agentv1.ActivityOp_ACTIVITY_OP_MODIFY:    "modify",
	agentv1.ActivityOp_ACTIVITY_OP_CREATE:    "create",
	agentv1.ActivityOp_ACTIVITY_OP_DELETE:    "delete",
	agentv1.ActivityOp_ACTIVITY_OP_MOVE_FROM: "move_from",
	agentv1.ActivityOp_ACTIVITY_OP_MOVE_TO:   "move_to",
}

// checked is what is kept of one message.
type checked struct {
	events []audit.ActivityEvent
	// dropped is the guest's own count plus the events refused here.
	dropped uint64
	// refused names the first reason an event was refused, for the log.
	refused string
}

// errGuest is a message that breaks the protocol.
type errGuest string

func (e errGuest) Error() string { return "guest broke the activity protocol: " + string(e) }

// check validates a message from the guest. A message with more than
// MaxEvents events is an error; an event that is invalid is counted as
// dropped, with the reason of the first kept in refused.
func check(msg *agentv1.ActivityResponse) (checked, error) {
	if n := len(msg.GetEvents()); n > MaxEvents {
		return checked{}, errGuest(fmt.Sprintf("%d events in one message, the cap is %d", n, MaxEvents))
	}
	if n := proto.Size(msg); n > MaxMessageBytes {
		return checked{}, errGuest(fmt.Sprintf("a message of %d bytes, the cap is %d", n, MaxMessageBytes))
	}
	c := checked{dropped: msg.GetDropped(), events: make([]audit.ActivityEvent, 0, len(msg.GetEvents()))}
	for _, e := range msg.GetEvents() {
		ev, why := checkEvent(e)
		if why != "" {
			c.dropped = addSat(c.dropped, 1)
			if c.refused == "" {
				c.refused = why
			}
			continue
		}
		c.events = append(c.events, ev)
	}
	return c, nil
}

// checkEvent returns the event as recorded, or why it is refused.
func checkEvent(e *agentv1.ActivityEvent) (audit.ActivityEvent, string) {
	if e == nil {
		return audit.ActivityEvent{}, "a missing event"
	}
	op, ok := ops[e.Op]
	switch {
	case !ok:
		return audit.ActivityEvent{}, fmt.Sprintf("unknown op %d", int32(e.Op))
	case e.Pid <= 0:
		return audit.ActivityEvent{}, fmt.Sprintf("pid %d", e.Pid)
	case e.AgeNs < 0 || e.AgeNs > maxAgeNs:
		return audit.ActivityEvent{}, fmt.Sprintf("age %d ns", e.AgeNs)
	case !protocol.ValidExecID(e.ExecId):
		return audit.ActivityEvent{}, "an invalid exec id"
	}
	if why := checkPath(e.Path); why != "" {
		return audit.ActivityEvent{}, why
	}
	return audit.ActivityEvent{Op: op, Path: e.Path, PID: e.Pid, ExecID: e.ExecId, Ns: e.AgeNs}, ""
}

// checkPath: absolute, clean, UTF-8, no NUL, at most MaxPathBytes.
func checkPath(p string) string {
	switch {
	case len(p) > MaxPathBytes:
		return fmt.Sprintf("a path of %d bytes", len(p))
	case !utf8.ValidString(p):
		return "a path that is not UTF-8"
	case !strings.HasPrefix(p, "/") || strings.IndexByte(p, 0) >= 0 || path.Clean(p) != p:
		return "a path that is not absolute and clean"
	}
	return ""
}

// dataOverhead is the room an audit.Activity takes besides its events:
// {"events":[],"dropped":18446744073709551615}.
const dataOverhead = len(`{"events":[],"dropped":18446744073709551615}`)

// chunks splits events into runs whose audit.Activity, whatever its dropped count,
// is at most audit.MaxDataSize bytes of JSON.
func chunks(events []audit.ActivityEvent) ([][]audit.ActivityEvent, error) {
	var out [][]audit.ActivityEvent
	start, size := 0, dataOverhead
	for i, e := range events {
		b, err := json.Marshal(e)
		if err != nil {
			return nil, err
		}
		extra := len(b) + 1 // and a comma
		if dataOverhead+extra > audit.MaxDataSize {
			return nil, fmt.Errorf("activity: one event takes %d bytes of JSON", len(b))
		}
		if size+extra > audit.MaxDataSize {
			out = append(out, events[start:i])
			start, size = i, dataOverhead
		}
		size += extra
	}
	if start < len(events) {
		out = append(out, events[start:])
	}
	return out, nil
}

// addSat adds without wrapping around.
func addSat(a, b uint64) uint64 {
	if a+b < a {
		return ^uint64(0)
	}
	return a + b
}
