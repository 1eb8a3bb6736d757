package relay

import (
	"bytes"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

func marshalWrite(t testing.TB, m *agentv1.WriteRequest) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func dataMessage(d []byte) *agentv1.WriteRequest {
	return &agentv1.WriteRequest{Msg: &agentv1.WriteRequest_Data{Data: d}}
}

// writeEncodings are WriteRequests as a client may send them, the odd
// ones included.
func writeEncodings(t testing.TB) map[string][]byte {
	header := marshalWrite(t, &agentv1.WriteRequest{Msg: &agentv1.WriteRequest_Header{Header: &agentv1.WriteHeader{Path: "/workspace/a", Mode: 0o600}}})
	data := marshalWrite(t, dataMessage(bytes.Repeat([]byte("carrel"), 1000)))
	other := marshalWrite(t, dataMessage([]byte("other")))
	unknown := protowire.AppendTag(nil, 9, protowire.VarintType)
	unknown = protowire.AppendVarint(unknown, 7)
	return map[string][]byte{
		"header":              header,
		"data":                data,
		"empty data":          marshalWrite(t, dataMessage([]byte{})),
		"commit":              marshalWrite(t, &agentv1.WriteRequest{Msg: &agentv1.WriteRequest_Commit{Commit: &agentv1.WriteCommit{}}}),
		"data twice":          append(append([]byte{}, data...), other...),
		"header then data":    append(append([]byte{}, header...), data...),
		"data then header":    append(append([]byte{}, data...), header...),
		"data, unknown":       append(append([]byte{}, data...), unknown...),
		"unknown, data":       append(append([]byte{}, unknown...), data...),
		"data cut short":      data[:len(data)-1],
		"data, wrong type":    protowire.AppendVarint(protowire.AppendTag(nil, writeDataField, protowire.VarintType), 5),
		"length past the end": protowire.AppendVarint(protowire.AppendTag(nil, writeDataField, protowire.BytesType), 100),
	}
}

// checkLikeProto fails unless decoding b into a writeMessage (through
// Codec) gives what proto gives a WriteRequest.
func checkLikeProto(t *testing.T, b []byte) {
	t.Helper()
	want := new(agentv1.WriteRequest)
	wantErr := proto.Unmarshal(b, want)
	var w writeMessage
	w.data = make([]byte, 0, 16) // a buffer left from an earlier message
	w.data = append(w.data, "stale"...)
	err := Codec{}.Unmarshal(b, &w)
	if (err != nil) != (wantErr != nil) {
		t.Fatalf("error %v, proto's %v", err, wantErr)
	}
	if err != nil {
		return
	}
	data, isData := w.chunk()
	wantData, wantIsData := want.Msg.(*agentv1.WriteRequest_Data)
	switch {
	case isData != wantIsData:
		t.Fatalf("data message %v, proto's %v", isData, wantIsData)
	case isData && !bytes.Equal(data, wantData.Data):
		t.Fatalf("data %q, proto's %q", data, wantData.Data)
	case !isData && !proto.Equal(w.msg, want):
		t.Fatalf("message %v, proto's %v", w.msg, want)
	}
}

func TestWriteMessageDecodesAsProtoDoes(t *testing.T) {
	for name, b := range writeEncodings(t) {
		t.Run(name, func(t *testing.T) { checkLikeProto(t, b) })
	}
}

func FuzzWriteMessage(f *testing.F) {
	for _, b := range writeEncodings(f) {
		f.Add(b)
	}
	f.Fuzz(checkLikeProto)
}

// A data message lands in the buffer the one before it used: the relay
// allocates nothing per message.
func TestWriteMessageReusesItsBuffer(t *testing.T) {
	first := marshalWrite(t, dataMessage(bytes.Repeat([]byte{1}, 64<<10)))
	second := marshalWrite(t, dataMessage(bytes.Repeat([]byte{2}, 32<<10)))
	var w writeMessage
	if err := (Codec{}).Unmarshal(first, &w); err != nil {
		t.Fatal(err)
	}
	a, _ := w.chunk()
	w.reset()
	if err := (Codec{}).Unmarshal(second, &w); err != nil {
		t.Fatal(err)
	}
	b, _ := w.chunk()
	if &a[0] != &b[0] || len(b) != 32<<10 || b[0] != 2 {
		t.Fatalf("second data message not decoded into the first one's buffer (len %d)", len(b))
	}
	allocs := testing.AllocsPerRun(100, func() {
		w.reset()
		if err := (Codec{}).Unmarshal(first, &w); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per data message, want 0", allocs)
	}
}

// A reset message is empty: connect calls no codec for a message of no
// bytes, and what the one before held must not be taken for it.
func TestWriteMessageResetIsEmpty(t *testing.T) {
	var w writeMessage
	if err := (Codec{}).Unmarshal(marshalWrite(t, dataMessage([]byte("x"))), &w); err != nil {
		t.Fatal(err)
	}
	w.reset()
	if _, isData := w.chunk(); isData || w.msg.GetHeader() != nil || w.msg.GetCommit() != nil {
		t.Fatalf("reset message is not empty: %+v", w)
	}
}

// Another codec (connect's JSON one) decodes into the message writeMessage
// stands for.
func TestWriteMessageOtherCodec(t *testing.T) {
	for _, m := range []*agentv1.WriteRequest{dataMessage([]byte("hello")), {Msg: &agentv1.WriteRequest_Commit{Commit: &agentv1.WriteCommit{}}}} {
		j, err := protojson.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		var w writeMessage
		if err := protojson.Unmarshal(j, &w); err != nil {
			t.Fatal(err)
		}
		data, isData := w.chunk()
		switch m.Msg.(type) {
		case *agentv1.WriteRequest_Data:
			if !isData || string(data) != "hello" {
				t.Fatalf("JSON data message decoded as %q (data %v)", data, isData)
			}
		default:
			if isData || w.msg.GetCommit() == nil {
				t.Fatalf("JSON commit decoded as %+v", w.msg)
			}
		}
	}
}

// Codec is connect's protobuf codec for every other message.
func TestCodecOtherMessages(t *testing.T) {
	in := &agentv1.StatRequest{Path: "/workspace"}
	b, err := Codec{}.Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	out := new(agentv1.StatRequest)
	if err := (Codec{}).Unmarshal(b, out); err != nil || !proto.Equal(in, out) {
		t.Fatalf("round trip: %v, %v", out, err)
	}
	if err := (Codec{}).Unmarshal(b, new(int)); err == nil {
		t.Fatal("decoded into a non-message")
	}
}

// A writeMessage given back keeps its data buffer for the next upload,
// emptied, unless the buffer is over maxPooledData.
func TestReleaseKeepsOnlyModestBuffers(t *testing.T) {
	w := takeWriteMessage()
	w.isData, w.data = true, make([]byte, 10, 1<<20)
	w.release()
	if w.isData || len(w.data) != 0 || cap(w.data) != 1<<20 {
		t.Errorf("released: isData %v, len %d, cap %d; want an empty 1 MiB buffer", w.isData, len(w.data), cap(w.data))
	}
	big := takeWriteMessage()
	big.data = make([]byte, maxPooledData+1)
	big.release()
	if big.data != nil {
		t.Errorf("a %d-byte buffer was kept", maxPooledData+1)
	}
}
