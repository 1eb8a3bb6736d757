package audit

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/carrel-os/carrel/supervisor/cas"
)

// Provenance says who vouches for a record.
type Provenance string

const (
	// Host: carreld observed it.
	Host Provenance = "host"
	// Guest: carrel-agent reported it; the guest may lie.
	Guest Provenance = "guest"
)

// Kinds of record. Kind is free-form within [validKind]; these are the
// ones carrel writes.
const (
	KindVMLifecycle    = "vm.lifecycle"
	KindAPICall        = "api.call"
	KindPolicyDecision = "policy.decision"
	KindExecStart      = "exec.start"
	KindExecExit       = "exec.exit"
	KindExecOutput     = "exec.output"
	KindFileOp         = "file.op"
	KindWatchEvent     = "watch.event"
	KindFileActivity   = "file.activity"
	KindNetEgress      = "net.egress"
	KindGuestRequest   = "guest.request"
	KindIntent         = "action.intent"
	KindOutcome        = "action.outcome"
	// A VM's GPUs: handed to it before its QEMU starts, and given back to
	// the host when the run ends.
	KindGPUAttach = "gpu.attach"
	KindGPUDetach = "gpu.detach"
	// KindRecovery records what the log itself did to recover: a torn
	// tail cut at Open, or a period of unavailability.
	KindRecovery = "audit.recovery"
	// KindWitness records a witness starting to fail (or refuse) to
	// cosign the log's checkpoints, or cosigning again.
	KindWitness = "audit.witness"
	// KindSegment is the first record of each segment after the first:
	// the log rolled over to a new records.log (SegmentStart).
	KindSegment = "audit.segment"
)

// Caps on one record.
const (
	MaxDataSize   = 64 << 10 // Record.Data
	MaxRecordSize = 1 << 20  // the serialized record
	maxNameSize   = 256      // VM and Session
	maxKindSize   = 64
	maxBlobRefs   = 1024
	// maxPrefix bounds `{"seq":N,"time":"...",` that the committer adds.
	maxPrefix = len(`{"seq":18446744073709551615,"time":"2006-01-02T15:04:05.999999999Z",`)
)

// Record is one entry of the log.
type Record struct {
	// Seq is the record's index in the log, set by the log.
	Seq uint64 `json:"seq"`
	// Time is when the record's group commit was written (UTC), set by
	// the log: records committed together share it.
	Time       time.Time  `json:"time"`
	Kind       string     `json:"kind"`
	VM         string     `json:"vm,omitempty"`
	Session    string     `json:"session,omitempty"`
	Provenance Provenance `json:"provenance"`
	// Intent is, on an outcome, the seq of its "action.intent" record.
	Intent *uint64 `json:"intent,omitempty"`
	// Blobs are "sha256:<hex>" references to blobs stored with PutBlob, or
	// CreateBlob and a commit.
	Blobs []string `json:"blobs,omitempty"`
	// Data is the kind-specific body, at most MaxDataSize bytes of JSON.
	Data json.RawMessage `json:"data,omitempty"`
}

// recordBody is Record less what the committer fills in. Its fields, in
// this order, follow seq and time in every payload.
type recordBody struct {
	Kind       string          `json:"kind"`
	VM         string          `json:"vm,omitempty"`
	Session    string          `json:"session,omitempty"`
	Provenance Provenance      `json:"provenance"`
	Intent     *uint64         `json:"intent,omitempty"`
	Blobs      []string        `json:"blobs,omitempty"`
	Data       json.RawMessage `json:"data,omitempty"`
}

// validKind: 1 to 64 of [a-z0-9._-].
func validKind(k string) bool {
	if k == "" || len(k) > maxKindSize {
		return false
	}
	for i := 0; i < len(k); i++ {
		c := k[i]
		if !('a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

// encodeBody checks r and returns its JSON without seq and time:
// `{"kind":...}`.
func encodeBody(r *Record) ([]byte, error) {
	if len(r.Data) > MaxDataSize {
		return nil, fmt.Errorf("%w: data is %d bytes, the cap is %d", ErrTooLarge, len(r.Data), MaxDataSize)
	}
	return encodeLarge(r)
}

// encodeLarge is encodeBody for the log's own records, whose data is
// capped only by MaxRecordSize: an audit.segment record lists every
// intent still open.
func encodeLarge(r *Record) ([]byte, error) {
	switch {
	case !validKind(r.Kind):
		return nil, fmt.Errorf("%w: kind %q: want 1 to %d of [a-z0-9._-]", ErrInvalid, r.Kind, maxKindSize)
	case r.Provenance != Host && r.Provenance != Guest:
		return nil, fmt.Errorf("%w: provenance %q: want %q or %q", ErrInvalid, r.Provenance, Host, Guest)
	case len(r.VM) > maxNameSize || len(r.Session) > maxNameSize:
		return nil, fmt.Errorf("%w: vm or session longer than %d bytes", ErrInvalid, maxNameSize)
	case !utf8.ValidString(r.VM) || !utf8.ValidString(r.Session):
		return nil, fmt.Errorf("%w: vm or session is not UTF-8", ErrInvalid)
	case len(r.Blobs) > maxBlobRefs:
		return nil, fmt.Errorf("%w: %d blob references, the cap is %d", ErrTooLarge, len(r.Blobs), maxBlobRefs)
	}
	for _, b := range r.Blobs {
		if !cas.Valid(b) {
			return nil, fmt.Errorf("%w: blob reference %q: want sha256:<64 hex>", ErrInvalid, b)
		}
	}
	if len(r.Data) > 0 && !json.Valid(r.Data) {
		return nil, fmt.Errorf("%w: data is not JSON", ErrInvalid)
	}
	body, err := json.Marshal(recordBody{
		Kind: r.Kind, VM: r.VM, Session: r.Session, Provenance: r.Provenance,
		Intent: r.Intent, Blobs: r.Blobs, Data: r.Data,
	})
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if len(body)+maxPrefix > MaxRecordSize {
		return nil, fmt.Errorf("%w: record is %d bytes, the cap is %d", ErrTooLarge, len(body)+maxPrefix, MaxRecordSize)
	}
	return body, nil
}

// appendPayload appends the full record: seq and time, then body (whose
// leading '{' it replaces). ts is the time as RFC 3339 with nanoseconds,
// which is how encoding/json writes a time.Time.
func appendPayload(dst []byte, seq uint64, ts, body []byte) []byte {
	dst = append(dst, `{"seq":`...)
	dst = strconv.AppendUint(dst, seq, 10)
	dst = append(dst, `,"time":"`...)
	dst = append(dst, ts...)
	dst = append(dst, `",`...)
	return append(dst, body[1:]...)
}

// Decode parses one payload from records.log.
func Decode(payload []byte) (Record, error) {
	var r Record
	d := json.NewDecoder(bytes.NewReader(payload))
	d.DisallowUnknownFields()
	if err := d.Decode(&r); err != nil {
		return Record{}, fmt.Errorf("decode audit record: %w", err)
	}
	return r, nil
}
