// Package activity records what a VM's agent reports its commands did in
// the workspace (the guest's Activity stream, fanotify in the guest) as
// file.activity audit records of provenance guest.
//
// The guest is hostile, so everything it sends is checked (check.go):
// at most MaxEvents events a message (more ends the stream), each event's
// op known, its path absolute, clean, UTF-8 and at most MaxPathBytes, its
// pid positive, its exec id short and plain. An event that fails is not
// recorded but counted in the record's dropped, and so is every event over
// the VM's budget: a rate of events and of records, each averaged over a
// window (Config). A guest sending messages faster than that has its
// stream ended. Nothing the guest sends is held beyond the message at
// hand. When the stream ends while the VM runs, Run opens another, after a
// backoff unless the stream ended on its own deadline.
package activity

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/supervisor/agentlink"
	"github.com/carrel-os/carrel/supervisor/audit"
)

// Recorder is where the records go: *audit.Log.
type Recorder interface {
	Append(ctx context.Context, rec audit.Record) (uint64, error)
}

// Dialer gives the client of the agent's current connection, and the
// function every error of a call made with it must be passed to (it ends
// a connection the guest broke the protocol on): *agentlink.Link.
type Dialer interface {
	Agent() (agentv1connect.AgentServiceClient, func(context.Context, error) error)
}

var (
	_ Recorder = (*audit.Log)(nil)
	_ Dialer   = (*agentlink.Link)(nil)
)

// Defaults for Config.
const (
	DefaultRate           = 2000 // events a second
	DefaultRecordRate     = 20   // records a second
	DefaultWindow         = 10 * time.Second
	DefaultStreamLifetime = time.Hour
	DefaultMinBackoff     = time.Second
	DefaultMaxBackoff     = 30 * time.Second
	// appendTimeout bounds one record's append.
	appendTimeout = 30 * time.Second
)

// ErrUnsupported is returned by Run when the guest does not report
// activity (an older agent, or one that cannot watch).
var ErrUnsupported = errors.New("the guest agent does not report workspace activity")

// Config is one VM's recording. Zero fields take the defaults.
type Config struct {
	Agent   Dialer
	Audit   Recorder
	VM      string
	Session string
	Log     *slog.Logger
	// Rate and RecordRate are the events and the records a second the VM
	// may have recorded, averaged over Window (up to Window's worth may
	// come at once). Events beyond are counted in dropped.
	Rate       float64
	RecordRate float64
	Window     time.Duration
	// StreamLifetime is each stream's deadline; a stream that reaches it
	// is reopened at once.
	StreamLifetime time.Duration
	// MinBackoff and MaxBackoff bound the wait before reopening a stream
	// that failed; it doubles with each failure in a row.
	MinBackoff, MaxBackoff time.Duration
}

// Run records the VM's activity until ctx ends (it returns nil) or the
// guest does not report activity (ErrUnsupported). vm and session name
// the records' VM and session.
func Run(ctx context.Context, agent Dialer, rec Recorder, vm, session string, log *slog.Logger) error {
	return Config{Agent: agent, Audit: rec, VM: vm, Session: session, Log: log}.Run(ctx)
}

// Run is the package's Run with c's settings.
func (c Config) Run(ctx context.Context) error {
	c = c.withDefaults()
	r := &recorder{cfg: c, log: c.Log.With("subsystem", "activity", "vm", c.VM), budget: newBudget(c, time.Now())}
	defer r.flushDropped()
	backoff := c.MinBackoff
	for ctx.Err() == nil {
		progress, err := r.stream(ctx)
		switch {
		case ctx.Err() != nil:
			return nil
		case connect.CodeOf(err) == connect.CodeUnimplemented:
			r.log.Warn("the guest agent does not report workspace activity", "err", err)
			return fmt.Errorf("%w: %w", ErrUnsupported, err)
		case errors.Is(err, errLifetime):
			backoff = c.MinBackoff
			continue
		}
		if _, broke := errors.AsType[errGuest](err); progress && !broke {
			backoff = c.MinBackoff
		}
		r.log.Debug("activity stream ended; reopening", "err", err, "in", backoff)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, c.MaxBackoff)
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.Log == nil {
		c.Log = slog.Default()
	}
	if c.Rate <= 0 {
		c.Rate = DefaultRate
	}
	if c.RecordRate <= 0 {
		c.RecordRate = DefaultRecordRate
	}
	if c.Window <= 0 {
		c.Window = DefaultWindow
	}
	if c.StreamLifetime <= 0 {
		c.StreamLifetime = DefaultStreamLifetime
	}
	if c.MinBackoff <= 0 {
		c.MinBackoff = DefaultMinBackoff
	}
	if c.MaxBackoff < c.MinBackoff {
		c.MaxBackoff = max(DefaultMaxBackoff, c.MinBackoff)
	}
	return c
}

// errLifetime marks a stream that reached its deadline.
var errLifetime = errors.New("activity stream reached its lifetime")

// recorder turns the guest's messages into records, within the budget.
type recorder struct {
	cfg    Config
	log    *slog.Logger
	budget *budget
	// dropped is what the next record will say was lost: counted by the
	// guest, refused here, over the budget, or not written.
	dropped uint64
	// warned: an invalid event has been logged in this stream.
	warned bool
}

// stream opens one stream and records it until it ends. progress says
// whether the guest sent anything valid.
func (r *recorder) stream(ctx context.Context) (progress bool, err error) {
	client, done := r.cfg.Agent.Agent()
	sctx, cancel := context.WithTimeoutCause(ctx, r.cfg.StreamLifetime, errLifetime)
	defer cancel()
	s, err := client.Activity(sctx, connect.NewRequest(&agentv1.ActivityRequest{}))
	if err != nil {
		return false, done(ctx, err)
	}
	defer s.Close()
	r.warned = false
	for s.Receive() {
		if err := r.message(ctx, s.Msg()); err != nil {
			cancel() // first, so that Close does not drain a flood
			r.log.Warn("ending the guest's activity stream", "err", err)
			return progress, err
		}
		progress = true
	}
	err = s.Err()
	if context.Cause(sctx) == errLifetime && ctx.Err() == nil {
		return progress, errLifetime
	}
	return progress, done(ctx, err)
}

// message records one message: its valid events within the budget, in as
// many records as their size takes (each within the record budget), with
// what was lost counted in the first.
func (r *recorder) message(ctx context.Context, msg *agentv1.ActivityResponse) error {
	now := time.Now()
	if !r.budget.message(now) {
		return errGuest("messages over the rate")
	}
	c, err := check(msg)
	if err != nil {
		return err
	}
	if c.refused != "" && !r.warned {
		r.warned = true
		r.log.Warn("refused invalid activity events from the guest", "reason", c.refused)
	}
	r.dropped = addSat(r.dropped, c.dropped)
	events := c.events
	if n := r.budget.events(now, len(events)); n < len(events) {
		r.dropped = addSat(r.dropped, uint64(len(events)-n))
		events = events[:n]
	}
	runs, err := chunks(events)
	if err != nil {
		return err
	}
	for _, run := range runs {
		if !r.budget.record(now) {
			r.dropped = addSat(r.dropped, uint64(len(run)))
			continue
		}
		r.write(ctx, run)
	}
	if len(runs) == 0 && r.dropped > 0 && r.budget.record(now) {
		r.write(ctx, nil) // only a count of what was lost
	}
	return nil
}

// write appends one record of events and the dropped count. A record that
// cannot be written is counted as dropped in the next.
func (r *recorder) write(ctx context.Context, events []audit.ActivityEvent) {
	if events == nil {
		events = []audit.ActivityEvent{}
	}
	data, err := json.Marshal(audit.Activity{Events: events, Dropped: r.dropped})
	if err == nil {
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), appendTimeout)
		_, err = r.cfg.Audit.Append(actx, audit.Record{
			Kind: audit.KindFileActivity, VM: r.cfg.VM, Session: r.cfg.Session, Provenance: audit.Guest, Data: data,
		})
		cancel()
	}
	if err != nil {
		r.log.Error("workspace activity not recorded", "events", len(events), "err", err)
		r.dropped = addSat(r.dropped, uint64(len(events)))
		return
	}
	r.dropped = 0
}

// flushDropped records a last count of what was lost, if any, as Run ends.
func (r *recorder) flushDropped() {
	if r.dropped > 0 {
		r.write(context.Background(), nil)
	}
}

// budget holds a VM to its rates of events and records, and of messages:
// a guest may send no more than messagesPerRecord times as many messages
// as it may have records written.
type budget struct {
	ev, rec, msg bucket
}

const messagesPerRecord = 4

func newBudget(c Config, now time.Time) *budget {
	return &budget{
		ev:  newBucket(c.Rate, c.Window, now),
		rec: newBucket(c.RecordRate, c.Window, now),
		msg: newBucket(messagesPerRecord*c.RecordRate, c.Window, now),
	}
}

// message reports whether one more message is within the rate.
func (b *budget) message(now time.Time) bool { return b.msg.take(now) }

// events returns how many of n events may be recorded now.
func (b *budget) events(now time.Time, n int) int {
	b.ev.fill(now)
	k := min(n, int(b.ev.tokens))
	b.ev.tokens -= float64(k)
	return k
}

// record reports whether a record may be written now.
func (b *budget) record(now time.Time) bool { return b.rec.take(now) }

// bucket is a token bucket: rate tokens a second, at most window's worth.
type bucket struct {
	rate, cap, tokens float64
	last              time.Time
}

func newBucket(rate float64, window time.Duration, now time.Time) bucket {
	c := rate * window.Seconds()
	return bucket{rate: rate, cap: c, tokens: c, last: now}
}

func (b *bucket) fill(now time.Time) {
	if d := now.Sub(b.last); d > 0 {
		b.tokens = min(b.cap, b.tokens+d.Seconds()*b.rate)
		b.last = now
	}
}

// take spends a token, if there is one.
func (b *bucket) take(now time.Time) bool {
	b.fill(now)
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}
