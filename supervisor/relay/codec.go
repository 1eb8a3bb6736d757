package relay

import (
	"fmt"
	"sync"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

// An upload arrives as WriteRequest messages of up to a MiB of data each.
// Decoded the usual way, each message's data is a fresh buffer, and at
// carreld's small live heap that rate of allocation runs the collector
// several times a second for as long as the transfer lasts: a quarter of
// carreld's CPU time in an upload, taken from the host CPUs the VM's QEMU
// threads are waiting for. So the bulk relay reads its data messages into
// one buffer of its own, which it reuses from message to message
// (writeMessage), through the FileService handler's codec (Codec). The
// buffers outlive uploads too (takeWriteMessage): most uploads are small
// files of a message or two, and a buffer of their own was nearly all
// that such an upload allocated.

// Codec is the protobuf codec of carreld's FileService handler
// (connect.WithCodec). It is connect's own binary codec, plus one case:
// it decodes into a *writeMessage, which only the bulk relay asks for.
type Codec struct{}

// Name is the protobuf codec's name, so Codec stands in for connect's.
func (Codec) Name() string { return "proto" }

// Marshal encodes a protobuf message.
func (Codec) Marshal(m any) ([]byte, error) { return Codec{}.MarshalAppend(nil, m) }

// MarshalAppend encodes a protobuf message onto b.
func (Codec) MarshalAppend(b []byte, m any) ([]byte, error) {
	pm, ok := m.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("marshal %T: not a protobuf message", m)
	}
	return proto.MarshalOptions{}.MarshalAppend(b, pm)
}

// Unmarshal decodes b into m, a protobuf message or a *writeMessage. b is
// connect's buffer, which it reuses once Unmarshal returns: nothing here
// keeps it.
func (Codec) Unmarshal(b []byte, m any) error {
	if w, ok := m.(*writeMessage); ok {
		return w.unmarshal(b)
	}
	pm, ok := m.(proto.Message)
	if !ok {
		return fmt.Errorf("unmarshal into %T: not a protobuf message", m)
	}
	if err := proto.Unmarshal(b, pm); err != nil {
		return fmt.Errorf("unmarshal into %T: %w", m, err)
	}
	return nil
}

// MarshalStable encodes a protobuf message deterministically.
func (Codec) MarshalStable(m any) ([]byte, error) {
	pm, ok := m.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("marshal %T: not a protobuf message", m)
	}
	return proto.MarshalOptions{Deterministic: true}.Marshal(pm)
}

// IsBinary is true: protobuf's encoding is not text.
func (Codec) IsBinary() bool { return true }

// writeDataField is WriteRequest's data field (files.proto).
const writeDataField protowire.Number = 2

// writeMessage is a WriteRequest as the bulk relay reads it. Codec copies
// a data message's bytes into data, whose array the next data message
// reuses: they are good until the next receive. Anything else is decoded
// into msg, which is also what any other codec (JSON) decodes into, since
// writeMessage is a protobuf message standing for msg (ProtoReflect).
// After a receive, a message that sets nothing (a client may send an
// empty one) has neither.
type writeMessage struct {
	isData bool
	data   []byte
	msg    *agentv1.WriteRequest
}

// maxPooledData is the largest data buffer kept for the next upload. The
// handler takes messages of at most a MiB (api's WithReadMaxBytes), so
// this is only a backstop.
const maxPooledData = 4 << 20

var writeMessages = sync.Pool{New: func() any { return new(writeMessage) }}

// takeWriteMessage returns an empty writeMessage, with the data buffer of
// an upload that ended if there is one. Give it back with release.
func takeWriteMessage() *writeMessage { return writeMessages.Get().(*writeMessage) }

// release gives w back for another upload: its data is no longer read.
func (w *writeMessage) release() {
	w.reset()
	if cap(w.data) > maxPooledData {
		w.data = nil
	}
	writeMessages.Put(w)
}

// ProtoReflect is msg's, made when first asked for.
func (w *writeMessage) ProtoReflect() protoreflect.Message {
	if w.msg == nil {
		w.msg = new(agentv1.WriteRequest)
	}
	return w.msg.ProtoReflect()
}

// unmarshal decodes one message. The common case, a message holding the
// data field and nothing else, is read by hand; anything else, a data
// field repeated or with other fields included, goes through proto, so
// that the result is what proto would give either way.
func (w *writeMessage) unmarshal(b []byte) error {
	w.reset()
	if num, typ, n := protowire.ConsumeTag(b); n > 0 && num == writeDataField && typ == protowire.BytesType {
		if v, m := protowire.ConsumeBytes(b[n:]); m > 0 && n+m == len(b) {
			w.isData, w.data = true, append(w.data, v...)
			return nil
		}
	}
	if err := proto.Unmarshal(b, w); err != nil {
		return fmt.Errorf("unmarshal into %T: %w", w.msg, err)
	}
	return nil
}

// chunk returns the message's data, and whether it is a data message.
func (w *writeMessage) chunk() ([]byte, bool) {
	if w.isData {
		return w.data, true
	}
	if d, ok := w.msg.GetMsg().(*agentv1.WriteRequest_Data); ok {
		return d.Data, true
	}
	return nil, false
}

// reset empties w before a receive: connect decodes nothing for a message
// of no bytes, and leaves what it is given as it was.
func (w *writeMessage) reset() { w.isData, w.data, w.msg = false, w.data[:0], nil }
