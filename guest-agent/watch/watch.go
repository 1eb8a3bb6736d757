// Package watch reports changes below a directory through inotify: creates,
// writes, deletes and renames, sent in batches and held to a rate. With
// Options.Recursive, every subdirectory is watched, including those made
// while the watch runs.
//
// What is reported:
//   - A rename within the watched tree is one Rename, from OldPath to Path
//     (inotify pairs the halves by cookie). A move out of the tree is a
//     Delete, a move in is a Create.
//   - A directory made during the watch is a Create, and so is everything
//     found in it when its own watch is added (entries made before inotify
//     could see them); a directory moved in is one Create, its contents
//     are watched but not reported.
//   - Writes to one path are merged into one Modify per batch. Attribute
//     changes (chmod, touch) are not reported.
//   - When the watched directory itself is removed or moved away, Run sends
//     a Delete for it and returns nil.
//
// What is lost is counted, never silent: events over the rate, events lost
// to the kernel's queue overflowing (at least one each time; a directory
// made in what was lost is not watched), and directories left unwatched
// because Options.MaxDirs (or the kernel's max_user_watches) was reached.
// A slow reader (send blocks) is what overflows the queue.
package watch

import (
	"time"
)

// Defaults for Options.
const (
	DefaultRate          = 1000
	DefaultMaxDirs       = 8192
	DefaultFlushInterval = 50 * time.Millisecond
	DefaultMaxBatch      = 256
	DefaultMaxBatchBytes = 512 << 10
)

// MaxPathBytes is the longest path an event may carry; events with longer
// paths are counted as dropped.
const MaxPathBytes = 4096

// Op is what happened to a path.
type Op uint8

const (
	Create Op = iota + 1
	Modify
	Delete
	Rename
)

func (o Op) String() string {
	switch o {
	case Create:
		return "CREATE"
	case Modify:
		return "MODIFY"
	case Delete:
		return "DELETE"
	case Rename:
		return "RENAME"
	}
	return "UNKNOWN"
}

// Event is one change.
type Event struct {
	Op Op
	// Path is absolute and begins with the watched directory's path as
	// given to Run. Names are the kernel's bytes: they may not be UTF-8.
	Path string
	// OldPath is where a Rename came from.
	OldPath string
	IsDir   bool
	// Time is when the event was read.
	Time time.Time
}

// Batch is what Run sends at once.
type Batch struct {
	Events []Event
	// Dropped counts events lost since the last batch.
	Dropped uint64
	// UnwatchedDirs counts directories found since the last batch that
	// are not watched, because of the cap on directories.
	UnwatchedDirs uint64
}

// Options tunes a watch. Zero fields take the defaults.
type Options struct {
	Recursive bool
	// Rate is the most events a second; the rest are dropped. Up to a
	// second's worth may come at once.
	Rate int
	// MaxDirs caps the directories one watch holds.
	MaxDirs int
	// FlushInterval is the longest an event waits to be sent.
	FlushInterval time.Duration
	// MaxBatch and MaxBatchBytes bound one Batch: its events, and roughly
	// the bytes of their paths.
	MaxBatch      int
	MaxBatchBytes int
}

func (o Options) withDefaults() Options {
	if o.Rate <= 0 {
		o.Rate = DefaultRate
	}
	if o.MaxDirs <= 0 {
		o.MaxDirs = DefaultMaxDirs
	}
	if o.FlushInterval <= 0 {
		o.FlushInterval = DefaultFlushInterval
	}
	if o.MaxBatch <= 0 {
		o.MaxBatch = DefaultMaxBatch
	}
	if o.MaxBatchBytes <= 0 {
		o.MaxBatchBytes = DefaultMaxBatchBytes
	}
	return o
}
