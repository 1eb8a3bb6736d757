package review

import (
	"encoding/json"
	"time"

	"github.com/carrel-os/carrel/supervisor/audit"
)

// Entry is one record: its payload exactly as in records.log, where it
// lies there, and its decoded form.
type Entry struct {
	audit.Record
	Offset  int64
	Payload []byte
}

// The data of the kinds of record docs/audit.md describes. Decoding is
// lenient: a field a later carreld adds is ignored, and a record whose
// data does not fit is shown by its raw data instead.

type lifecycleData struct {
	Event       string `json:"event"`
	ImageDigest string `json:"image_digest"`
	// ImageName and RootHash name the image and the dm-verity root hash
	// of its root file system; a created or starting record keeps the
	// image's manifest as a blob whose digest is ImageDigest.
	ImageName      string `json:"image_name"`
	RootHash       string `json:"root_hash"`
	Policy         string `json:"policy"`
	PolicyRevision string `json:"policy_revision"`
	MemoryBytes    int64  `json:"memory_bytes"`
	CPUs           int    `json:"cpus"`
	Driver         string `json:"driver"`
	Reason         string `json:"reason"`
}

type apiCallData struct {
	Procedure  string      `json:"procedure"`
	Caller     *callerData `json:"caller"`
	Decision   string      `json:"decision"`
	Code       string      `json:"code"`
	Error      string      `json:"error"`
	DurationNS int64       `json:"duration_ns"`
}

type callerData struct {
	Type    string `json:"type"`
	UID     uint32 `json:"uid"`
	PID     int32  `json:"pid"`
	TokenID string `json:"token_id"`
}

type decisionData struct {
	ID          string `json:"id"`
	Kind        string `json:"kind"`
	Policy      string `json:"policy"`
	Revision    string `json:"revision"`
	InputDigest string `json:"input_digest"`
	Allow       bool   `json:"allow"`
	Rule        string `json:"rule"`
	Reason      string `json:"reason"`
	Cached      bool   `json:"cached"`
}

// intentData is the union of the actions' parameters.
type intentData struct {
	Action string            `json:"action"`
	Caller *callerData       `json:"caller"`
	Argv   []string          `json:"argv"`
	Env    map[string]string `json:"env"`
	Cwd    string            `json:"cwd"`
	User   string            `json:"user"`
	TTY    bool              `json:"tty"`
	Detach bool              `json:"detach"`
	// An argv too large for a record is kept as its first word and count.
	Truncated bool            `json:"truncated"`
	Argv0     string          `json:"argv0"`
	Args      int             `json:"args"`
	Path      string          `json:"path"`
	To        string          `json:"to"`
	Mode      json.RawMessage `json:"mode"`
	UID       json.RawMessage `json:"uid"`
	GID       json.RawMessage `json:"gid"`
	Port      json.RawMessage `json:"port"`
	Tar       bool            `json:"tar"`
	Recursive bool            `json:"recursive"`
	Reason    string          `json:"reason"`
}

type exitData struct {
	Code        *int64 `json:"code"`
	Signal      string `json:"signal"`
	StdoutBytes int64  `json:"stdout_bytes"`
	StderrBytes int64  `json:"stderr_bytes"`
	StdinBytes  int64  `json:"stdin_bytes"`
	Error       string `json:"error"`
}

type outputData struct {
	Exec   *uint64    `json:"exec"`
	Stream string     `json:"stream"`
	Offset int64      `json:"offset"`
	Size   int64      `json:"size"`
	Chunks [][2]int64 `json:"chunks"` // [ns since the exec began, bytes]
}

type fileOpData struct {
	Op      string `json:"op"`
	Path    string `json:"path"`
	To      string `json:"to"`
	Size    *int64 `json:"size"`
	Digest  string `json:"digest"`
	Entries int    `json:"entries"` // a tar's
	Error   string `json:"error"`
	// Content says why a write's content is not kept as a blob.
	Content string `json:"content"`
}

// watchData is one event (path, op, size), or a batch of them (events).
type watchData struct {
	Watch  string `json:"watch"`
	Path   string `json:"path"`
	Op     string `json:"op"`
	Size   *int64 `json:"size"`
	Events []struct {
		Op      string `json:"op"`
		Path    string `json:"path"`
		OldPath string `json:"old_path"`
		Dir     bool   `json:"dir"`
	} `json:"events"`
	Dropped int64 `json:"dropped"`
}

type activityData struct {
	Events []struct {
		Op     string `json:"op"`
		Path   string `json:"path"`
		PID    int64  `json:"pid"`
		ExecID string `json:"exec_id"`
		NS     int64  `json:"ns"`
	} `json:"events"`
	Dropped int64 `json:"dropped"`
}

type outcomeData struct {
	Outcome        string `json:"outcome"`
	Reason         string `json:"reason"`
	BytesIn        *int64 `json:"bytes_in"`
	BytesOut       *int64 `json:"bytes_out"`
	BytesFromGuest *int64 `json:"bytes_from_guest"` // a port-forward's
	Error          string `json:"error"`
}

// gpuData is the data of gpu.attach and gpu.detach records.
type gpuData struct {
	GPUs   []string `json:"gpus"`
	Driver string   `json:"driver"`
	Reason string   `json:"reason"`
}

// egressData is the data of a net.egress record.
type egressData struct {
	PID       int32  `json:"pid"`
	Host      string `json:"host"`
	Port      uint32 `json:"port"`
	Protocol  string `json:"protocol"`
	Outcome   string `json:"outcome"`
	Rule      string `json:"rule"`
	IP        string `json:"ip"`
	BytesUp   int64  `json:"bytes_up"`
	BytesDown int64  `json:"bytes_down"`
	Error     string `json:"error"`
}

type recoveryData struct {
	Cause           string     `json:"cause"`
	TruncatedBytes  int64      `json:"truncated_bytes"`
	TailReason      string     `json:"tail_reason"`
	UnknownOutcomes int        `json:"unknown_outcomes"`
	Error           string     `json:"error"`
	Since           *time.Time `json:"since"`
	Refused         uint64     `json:"refused"`
}

// decodeData decodes e's data into v, reporting whether it fit.
func decodeData(e *Entry, v any) bool {
	return len(e.Data) > 0 && json.Unmarshal(e.Data, v) == nil
}

// execIntent returns the parameters of an exec intent, or nil when e is
// not one.
func execIntent(e *Entry) *intentData {
	if e.Kind != audit.KindIntent {
		return nil
	}
	var d intentData
	if !decodeData(e, &d) || d.Action != "exec" {
		return nil
	}
	return &d
}
