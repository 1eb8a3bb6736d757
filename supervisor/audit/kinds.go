package audit

import (
	"encoding/json"
	"time"
)

// The data of each kind of record, as carreld writes it and as review and
// rerun read it. A field's name, type, tag and order here are the log's
// format: records already written must keep reading the same, so change
// them only by adding fields (docs/audit.md lists them for people).

// Actions an "action.intent" names besides the file actions ("file.write",
// "file.mkdir", ...).
const (
	ActionExec    = "exec"
	ActionForward = "port.forward"
	ActionInput   = "exec.input"
)

// Lifecycle is the data of a "vm.lifecycle" record.
type Lifecycle struct {
	Event       string `json:"event"`
	ImageDigest string `json:"image_digest"`
	// ImageName and RootHash name the image and the dm-verity root hash
	// of its root file system (empty for an image without one). A
	// created or starting record also carries the image's manifest as a
	// blob (its digest is ImageDigest), with the image's every package.
	ImageName      string   `json:"image_name,omitempty"`
	RootHash       string   `json:"root_hash,omitempty"`
	Policy         string   `json:"policy"`
	PolicyRevision string   `json:"policy_revision,omitempty"`
	MemoryBytes    uint64   `json:"memory_bytes"`
	CPUs           uint32   `json:"cpus"`
	Driver         string   `json:"driver"`
	Reason         string   `json:"reason,omitempty"`
	GPUs           []string `json:"gpus,omitempty"`
	// Snapshot is the snapshot a "snapshot" or "snapshot-deleted" event
	// is about. Origin, on every record of a run that started from a
	// snapshot (a restore, or the fork that made the VM), is that
	// snapshot: its Session is the run's parent session.
	Snapshot *SnapshotRef `json:"snapshot,omitempty"`
	Origin   *SnapshotRef `json:"origin,omitempty"`
}

// SnapshotRef names a snapshot of a VM, taken in session Session.
type SnapshotRef struct {
	VM      string `json:"vm"`
	Name    string `json:"name"`
	Session string `json:"session"`
	// StateSHA256 and Bytes: the digest of its saved state (memory and
	// devices) and the bytes of its state and disk layers together.
	StateSHA256 string `json:"state_sha256,omitempty"`
	Bytes       uint64 `json:"bytes,omitempty"`
	// Fork: the run is a new VM's, forked from the snapshot. Guest: the
	// snapshot is a checkpoint the guest asked for.
	Fork  bool `json:"fork,omitempty"`
	Guest bool `json:"guest,omitempty"`
}

// GuestRequest is the data of a "guest.request" record: something a
// program in the guest asked carreld for (carrel-agent request), what the
// VM's carrel.guest policy decided, and what came of it. UID and PID are
// the guest kernel's word about the asker.
type GuestRequest struct {
	Request  string `json:"request"`
	Name     string `json:"name,omitempty"`
	Note     string `json:"note,omitempty"`
	UID      uint32 `json:"uid"`
	PID      int32  `json:"pid,omitempty"`
	Decision string `json:"decision,omitempty"`
	Rule     string `json:"rule,omitempty"`
	// Outcome: "done", "denied", "rate-limited", "invalid" or "failed".
	Outcome string `json:"outcome"`
	// Snapshot is the checkpoint taken, when done.
	Snapshot string `json:"snapshot,omitempty"`
	Error    string `json:"error,omitempty"`
}

// GPU is the data of a "gpu.attach" or "gpu.detach" record.
type GPU struct {
	// GPUs are the PCI addresses the VM was created with; the other
	// functions of their slots go with them.
	GPUs   []string `json:"gpus"`
	Driver string   `json:"driver"`
	Reason string   `json:"reason,omitempty"`
}

// Caller is who made an API call: a local process (SO_PEERCRED) or the
// holder of a token. policy.Caller is this type.
type Caller struct {
	Type string `json:"type"` // "peer" or "token"
	UID  uint32 `json:"uid,omitempty"`
	GID  uint32 `json:"gid,omitempty"`
	PID  int32  `json:"pid,omitempty"`
	// Groups names a peer's primary and supplementary groups.
	Groups  []string `json:"groups,omitempty"`
	TokenID string   `json:"token_id,omitempty"`
	VM      string   `json:"vm,omitempty"` // the VM a token (or a key's sandbox token) is scoped to
	// An API key's id and name, the images its VMs may boot and the policy
	// they get (CallerKey). Its VMs are those named "e2b-NAME-...".
	KeyID  string   `json:"key_id,omitempty"`
	Name   string   `json:"name,omitempty"`
	Images []string `json:"images,omitempty"`
	Policy string   `json:"policy,omitempty"`
}

// Caller types.
const (
	CallerPeer  = "peer"
	CallerToken = "token"
	CallerKey   = "key"
)

// MarshalJSON writes the fields of c's type only, all of them: a root
// peer has "uid": 0, not no uid. policy.Caller is this type, so a decision's
// recorded input and an intent's caller read the same.
func (c Caller) MarshalJSON() ([]byte, error) {
	switch c.Type {
	case CallerPeer:
		groups := c.Groups
		if groups == nil {
			groups = []string{}
		}
		return json.Marshal(struct {
			Type   string   `json:"type"`
			UID    uint32   `json:"uid"`
			GID    uint32   `json:"gid"`
			PID    int32    `json:"pid"`
			Groups []string `json:"groups"`
		}{c.Type, c.UID, c.GID, c.PID, groups})
	case CallerToken:
		return json.Marshal(struct {
			Type    string `json:"type"`
			TokenID string `json:"token_id"`
			VM      string `json:"vm"`
		}{c.Type, c.TokenID, c.VM})
	case CallerKey:
		images := c.Images
		if images == nil {
			images = []string{}
		}
		return json.Marshal(struct {
			Type   string   `json:"type"`
			KeyID  string   `json:"key_id"`
			Name   string   `json:"name"`
			Images []string `json:"images"`
			Policy string   `json:"policy"`
			VM     string   `json:"vm"`
		}{c.Type, c.KeyID, c.Name, images, c.Policy, c.VM})
	}
	return json.Marshal(struct {
		Type string `json:"type"`
	}{c.Type})
}

// APICall is the data of an "api.call" record: one call, after it ended.
type APICall struct {
	Procedure string  `json:"procedure"`
	Caller    *Caller `json:"caller,omitempty"`
	// Decision is the id of the call's api decision.
	Decision   string `json:"decision,omitempty"`
	Code       string `json:"code"` // "ok" or the connect error code
	Error      string `json:"error,omitempty"`
	DurationNs int64  `json:"duration_ns"`
	// Quota is the limit of the caller's API key that refused the call
	// (code "resource_exhausted").
	Quota *Quota `json:"quota,omitempty"`
}

// Quota is a limit of an API key's name (carrel key create --max-...)
// that a call would have gone over: what its VMs held, with what calls
// in flight had reserved, and what the call asked for besides.
type Quota struct {
	Limit string `json:"limit"` // "vms", "snapshots", "memory_bytes" or "disk_bytes"
	Max   uint64 `json:"max"`
	Used  uint64 `json:"used"`
	Asked uint64 `json:"asked"`
}

// Decision is the data of a "policy.decision" record: the fields of a
// policy.Decision, and its input document when that is small enough.
type Decision struct {
	ID          string    `json:"id"`
	Time        time.Time `json:"time"`
	Kind        string    `json:"kind"`
	VM          string    `json:"vm,omitempty"`
	Policy      string    `json:"policy"`
	Revision    string    `json:"revision"`
	InputDigest string    `json:"input_digest"`
	Allow       bool      `json:"allow"`
	Rule        string    `json:"rule"`
	Reason      string    `json:"reason"`
	Cached      bool      `json:"cached,omitempty"`
	// Input is the canonical input InputDigest hashes; omitted when large.
	Input json.RawMessage `json:"input,omitempty"`
}

// ExecIntent is the data of an exec's "action.intent": the command as the
// guest will run it, and who asked.
type ExecIntent struct {
	Action string            `json:"action"` // ActionExec
	Caller Caller            `json:"caller"`
	Argv   []string          `json:"argv"`
	Env    map[string]string `json:"env,omitempty"`
	Cwd    string            `json:"cwd"`
	User   string            `json:"user"`
	TTY    bool              `json:"tty,omitempty"`
	Detach bool              `json:"detach,omitempty"`
}

// ExecIntentTruncated stands for an ExecIntent too large for a record:
// the command's first word and its number of words. Its fields are in
// the order of their names (it was first written from a map).
type ExecIntentTruncated struct {
	Action    string `json:"action"` // ActionExec
	Args      int    `json:"args"`
	Argv0     string `json:"argv0"`
	Caller    Caller `json:"caller"`
	Truncated bool   `json:"truncated"` // true
}

// ExecExit is the data of an "exec.exit" record, the outcome of an exec.
type ExecExit struct {
	Code   *int32 `json:"code,omitempty"`
	Signal string `json:"signal,omitempty"`
	// ExecID is the guest's id for the command, which its file.activity
	// records name (as the guest reports it).
	ExecID      string `json:"exec_id,omitempty"`
	StdinBytes  int64  `json:"stdin_bytes"`
	StdoutBytes int64  `json:"stdout_bytes"`
	StderrBytes int64  `json:"stderr_bytes"`
	// Error says why the call ended without an exit status (a detached
	// command, a broken link, a timeout).
	Error string `json:"error,omitempty"`
}

// ExecOutput is the data of an "exec.output" record; its blob holds the
// bytes.
type ExecOutput struct {
	Exec   uint64 `json:"exec"`   // the seq of the exec's intent
	Stream string `json:"stream"` // "stdin", "stdout" or "stderr"
	Offset int64  `json:"offset"` // bytes of the stream before these
	Size   int64  `json:"size"`
	// Chunks are [ns since the intent, bytes], one per message relayed.
	Chunks [][2]int64 `json:"chunks"`
}

// FileIntent is the data of a file action's "action.intent".
type FileIntent struct {
	Action string `json:"action"` // "file.write", "file.remove", ...
	Caller Caller `json:"caller"`
	Path   string `json:"path"`
	To     string `json:"to,omitempty"`
	Mode   uint32 `json:"mode,omitempty"`
	UID    *int64 `json:"uid,omitempty"`
	GID    *int64 `json:"gid,omitempty"`
	Tar    bool   `json:"tar,omitempty"`
	// Recursive is set for a recursive remove and a mkdir with parents.
	Recursive bool `json:"recursive,omitempty"`
}

// FileOp is the data of a "file.op" record: what a file action did (its
// outcome), or a read.
type FileOp struct {
	Op      string `json:"op"`
	Path    string `json:"path"`
	To      string `json:"to,omitempty"`
	Size    int64  `json:"size"`
	Digest  string `json:"digest,omitempty"`
	Entries int    `json:"entries,omitempty"`
	Error   string `json:"error,omitempty"`
	// Content says why a write's content is not kept as a blob.
	Content string `json:"content,omitempty"`
}

// Watch is the data of a "watch.event" record.
type Watch struct {
	Watch   string       `json:"watch"` // the watched directory
	Events  []WatchEvent `json:"events"`
	Dropped uint64       `json:"dropped,omitempty"`
}

// WatchEvent is one event of a Watch.
type WatchEvent struct {
	Op      string `json:"op"`
	Path    string `json:"path"`
	OldPath string `json:"old_path,omitempty"`
	Dir     bool   `json:"dir,omitempty"`
	// TimeNs is when the guest says it saw the event (Unix ns).
	TimeNs int64 `json:"time_ns"`
}

// Activity is the data of a "file.activity" record.
type Activity struct {
	Events []ActivityEvent `json:"events"`
	// Dropped counts the events lost since the last record.
	Dropped uint64 `json:"dropped"`
}

// ActivityEvent is one event of an Activity.
type ActivityEvent struct {
	Op     string `json:"op"`
	Path   string `json:"path"`
	PID    int32  `json:"pid"`
	ExecID string `json:"exec_id"`
	// Ns is how long before the guest sent its batch it read the event.
	Ns int64 `json:"ns"`
}

// Egress is the data of a "net.egress" record: one request of a VM's
// egress proxy, written when it ends.
type Egress struct {
	// ID is the agent's id of the request; PID the process it named (what
	// the guest says).
	ID       uint64 `json:"id"`
	PID      int32  `json:"pid,omitempty"`
	Host     string `json:"host"`
	Port     uint32 `json:"port"`
	Protocol string `json:"protocol"`
	Outcome  string `json:"outcome"`
	// Decisions are the ids of the policy decisions made for it: the name,
	// then the name with its addresses. Rule is the last one's rule.
	Decisions []string `json:"decisions,omitempty"`
	Rule      string   `json:"rule,omitempty"`
	// Addresses are what the name resolved to; IP the one connected to.
	Addresses []string `json:"addresses,omitempty"`
	IP        string   `json:"ip,omitempty"`
	SNI       string   `json:"sni,omitempty"`
	// HTTPHost is the Host header of a plain HTTP request the connection
	// carried (checked against Host, as SNI is).
	HTTPHost   string `json:"http_host,omitempty"`
	BytesUp    int64  `json:"bytes_up"`
	BytesDown  int64  `json:"bytes_down"`
	DurationNs int64  `json:"duration_ns"`
	Error      string `json:"error,omitempty"`
}

// ForwardIntent is the data of a port-forward's "action.intent".
type ForwardIntent struct {
	Action string `json:"action"` // ActionForward
	Caller Caller `json:"caller"`
	Host   string `json:"host"`
	Port   uint32 `json:"port"`
}

// InputIntent is the data of the "action.intent" of input fed to a
// running command by a unary call (AgentService.Input): Input is "stdin"
// (the bytes are the record's blob), "close_stdin" or "resize".
type InputIntent struct {
	Action string `json:"action"` // ActionInput
	Caller Caller `json:"caller"`
	ExecID string `json:"exec_id"`
	Input  string `json:"input"`
	Bytes  int    `json:"bytes,omitempty"`
}

// InputOutcome is the data of an input's "action.outcome".
type InputOutcome struct {
	Error string `json:"error,omitempty"`
}

// ForwardOutcome is the data of a port-forward's "action.outcome".
type ForwardOutcome struct {
	BytesFromGuest int64  `json:"bytes_from_guest"`
	Error          string `json:"error,omitempty"`
}

// OutcomeData is the data of the "action.outcome" Open appends for an
// intent that was left open: Outcome is OutcomeUnknown.
type OutcomeData struct {
	Outcome string `json:"outcome"`
	Reason  string `json:"reason"`
}

// OutcomeUnknown is OutcomeData.Outcome for an intent a crash left open.
const OutcomeUnknown = "unknown"

// RecoveryData is the data of an "audit.recovery" record.
type RecoveryData struct {
	// Cause is "restart" (Open repaired the log) or "fault" (writing
	// failed for a while and works again).
	Cause           string     `json:"cause"`
	TruncatedAt     *int64     `json:"truncated_at,omitempty"`
	TruncatedBytes  int64      `json:"truncated_bytes,omitempty"`
	TailReason      string     `json:"tail_reason,omitempty"`
	UnknownOutcomes int        `json:"unknown_outcomes,omitempty"`
	Error           string     `json:"error,omitempty"`
	Since           *time.Time `json:"since,omitempty"`
	Refused         uint64     `json:"refused,omitempty"`
	// For cause "corruption", the first record of a log started again by
	// carrel audit recover: where the damaged log was sealed (below the
	// log's directory), how many records it held, the records that could
	// not be read, and its last checkpoint that the readable records match
	// (the note, signed), to which this log is chained.
	Sealed             string   `json:"sealed,omitempty"`
	SealedRecords      uint64   `json:"sealed_records,omitempty"`
	Unreadable         []uint64 `json:"unreadable,omitempty"`
	PreviousCheckpoint string   `json:"previous_checkpoint,omitempty"`
}

// DecodeIntent decodes an "action.intent" record's data into the type its
// action and shape call for: *ExecIntent, *ExecIntentTruncated,
// *ForwardIntent, or *FileIntent for any other action. Like
// json.Unmarshal, it ignores fields the type does not have.
func DecodeIntent(data []byte) (any, error) {
	var head struct {
		Action    string `json:"action"`
		Truncated bool   `json:"truncated"`
	}
	if err := json.Unmarshal(data, &head); err != nil {
		return nil, err
	}
	var v any
	switch {
	case head.Action == ActionExec && head.Truncated:
		v = &ExecIntentTruncated{}
	case head.Action == ActionExec:
		v = &ExecIntent{}
	case head.Action == ActionForward:
		v = &ForwardIntent{}
	case head.Action == ActionInput:
		v = &InputIntent{}
	default:
		v = &FileIntent{}
	}
	if err := json.Unmarshal(data, v); err != nil {
		return nil, err
	}
	return v, nil
}

// WitnessEvent is the data of an "audit.witness" record: a witness of the
// log's checkpoints started to fail ("failed": unreachable, slow, an answer
// that is not its cosignature; "refused": it would not cosign the
// checkpoint, which does not extend what it saw) or cosigns again
// ("cosigning"), at the checkpoint of Size records.
type WitnessEvent struct {
	Witness string `json:"witness"`
	Size    uint64 `json:"size"`
	Outcome string `json:"outcome"`
	Error   string `json:"error,omitempty"`
}

// SegmentStart is the data of an "audit.segment" record, the first of
// each segment after the first: it names the segment before it, how many
// records and bytes that holds, and the signed checkpoint at its end (a
// tree of this record's seq), so that verification runs on across the
// segments. OpenIntents are the intents that had no outcome yet when the
// log rolled over: recovery finds them here without reading older
// segments. More than inlineIntents of them go to a blob instead, as a
// JSON array, named by OpenIntentsBlob (and in the record's blobs), with
// their number in OpenIntentsCount: no number of actions in flight makes
// the record too large to write.
type SegmentStart struct {
	Previous         string      `json:"previous"`
	Records          uint64      `json:"records"`
	Bytes            int64       `json:"bytes"`
	Checkpoint       string      `json:"checkpoint"`
	OpenIntents      []IntentRef `json:"open_intents"`
	OpenIntentsBlob  string      `json:"open_intents_blob,omitempty"`
	OpenIntentsCount int         `json:"open_intents_count,omitempty"`
}

// IntentRef names an intent by its seq, with its VM and session.
type IntentRef struct {
	Seq     uint64 `json:"seq"`
	VM      string `json:"vm"`
	Session string `json:"session"`
}
