package audit

import (
	"errors"
	"fmt"
)

var (
	// ErrUnavailable means the log cannot make records durable (a write
	// or fsync failed); no action may be admitted until it recovers.
	ErrUnavailable = errors.New("audit log unavailable")
	// ErrClosed is returned by appends after Close.
	ErrClosed = errors.New("audit log closed")
	// ErrInvalid is returned for a record that breaks the format's rules.
	ErrInvalid = errors.New("invalid audit record")
	// ErrTooLarge is returned for a record or data over its cap.
	ErrTooLarge = errors.New("audit record too large")
	// ErrEnded is returned by a second Pending.End.
	ErrEnded = errors.New("action already ended")
	// ErrLocked means another process has the log open.
	ErrLocked = errors.New("audit log in use")
	// ErrCorrupt means records.log is damaged somewhere other than a torn
	// tail; Open refuses to discard what follows. Run Verify.
	ErrCorrupt = errors.New("audit log corrupt")
	// ErrRecordsLost means a signed checkpoint covers more records than
	// records.log holds: acknowledged records are gone.
	ErrRecordsLost = errors.New("audit log lost acknowledged records")
	// ErrCheckpointMismatch means the latest checkpoint does not verify
	// (bad signature) or its root does not match the records.
	ErrCheckpointMismatch = errors.New("audit log does not match its checkpoint")
)

// CorruptError locates damage that is not a torn tail.
type CorruptError struct {
	Offset int64  // byte offset of the bad frame in the log (all its segments)
	Seq    uint64 // the sequence number expected there
	Reason string
}

func (e *CorruptError) Error() string {
	return fmt.Sprintf("audit log corrupt at offset %d (record %d): %s", e.Offset, e.Seq, e.Reason)
}

func (e *CorruptError) Unwrap() error { return ErrCorrupt }

// LostError says how many acknowledged records are missing.
type LostError struct {
	Checkpoint uint64 // size of the latest signed checkpoint
	Records    uint64 // records found in records.log
}

func (e *LostError) Error() string {
	return fmt.Sprintf("audit log lost acknowledged records: checkpoint signed at %d records, records.log holds %d", e.Checkpoint, e.Records)
}

func (e *LostError) Unwrap() error { return ErrRecordsLost }

// CheckpointError describes a checkpoint that does not match the log.
type CheckpointError struct {
	Size   uint64
	Reason string
}

func (e *CheckpointError) Error() string {
	return fmt.Sprintf("audit checkpoint %d: %s", e.Size, e.Reason)
}

func (e *CheckpointError) Unwrap() error { return ErrCheckpointMismatch }
