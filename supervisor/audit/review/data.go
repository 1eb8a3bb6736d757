package review

import (
	"encoding/json"

	"github.com/carrel-os/carrel/supervisor/audit"
)

// Entry is one record: its payload exactly as in records.log, where it
// lies there, and its decoded form.
type Entry struct {
	audit.Record
	Offset  int64
	Payload []byte
}

// The data of each kind of record is its type in package audit
// (kinds.go). Decoding is lenient: a field a later carreld adds is
// ignored, and a record whose data does not fit is shown by its raw data
// instead.

// decodeData decodes e's data into v, reporting whether it fit.
func decodeData(e *Entry, v any) bool {
	return len(e.Data) > 0 && json.Unmarshal(e.Data, v) == nil
}

// execCommand is an exec intent as review reads it: the command, or
// when it was too large to record (Truncated is set), who asked for it.
type execCommand struct {
	audit.ExecIntent
	Truncated *audit.ExecIntentTruncated
}

// execIntent returns the parameters of an exec intent, or nil when e is
// not one.
func execIntent(e *Entry) *execCommand {
	if e.Kind != audit.KindIntent || len(e.Data) == 0 {
		return nil
	}
	v, err := audit.DecodeIntent(e.Data)
	if err != nil {
		return nil
	}
	switch d := v.(type) {
	case *audit.ExecIntent:
		return &execCommand{ExecIntent: *d}
	case *audit.ExecIntentTruncated:
		return &execCommand{ExecIntent: audit.ExecIntent{Action: d.Action, Caller: d.Caller}, Truncated: d}
	}
	return nil
}
