// Package guestreq serves what programs in a guest ask carreld for
// (carrel-agent request checkpoint, inside the VM). While the VM runs,
// carreld holds the agent's GuestRequests stream open; each request is
// rate-limited per VM, decided by the VM's carrel.guest policy, recorded
// as a guest.request audit record with its outcome, carried out when
// allowed, and answered. The stream is host-opened and never on carreld's
// API. The guest is not trusted: every field is bounded and checked here
// again, and the asker's uid and pid are recorded as the guest's word.
package guestreq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/recorder"
)

// Outcomes a guest.request record names.
const (
	OutcomeDone        = "done"
	OutcomeDenied      = "denied"
	OutcomeRateLimited = "rate-limited"
	OutcomeInvalid     = "invalid"
	OutcomeFailed      = "failed"
)

// Defaults: a guest may ask for DefaultBurst checkpoints at once, then one
// per DefaultEvery.
const (
	DefaultBurst = 3
	DefaultEvery = time.Minute
	maxNote      = 1024
)

// Link gives the agent's service on its current connection, and the
// function every error of a call made with it must be passed to:
// *agentlink.Link.
type Link interface {
	Agent() (agentv1connect.AgentServiceClient, func(context.Context, error) error)
}

// Policies decides guest inputs by the named policy (and records the
// decisions).
type Policies interface {
	Decide(ctx context.Context, name string, in policy.Input) (policy.Decision, error)
}

// Recorder appends audit records.
type Recorder interface {
	Append(ctx context.Context, rec audit.Record) (uint64, error)
}

// Checkpoint takes a snapshot of vm, marked as the guest's
// (vm.Manager.Snapshot with Guest set).
type Checkpoint func(ctx context.Context, vm, name, note string) error

// Config configures a Server.
type Config struct {
	Policies   Policies
	Audit      Recorder
	Checkpoint Checkpoint
	// Burst and Every make each VM's rate limit (0: the defaults).
	Burst int
	Every time.Duration
	Log   *slog.Logger
}

// VM is the VM whose requests a Serve call takes.
type VM struct {
	Name    string
	Session string
	// Policy names the VM's policy now.
	Policy func() string
}

// Server serves the guest requests of every VM of one carreld.
type Server struct {
	cfg Config
}

// New returns a server.
func New(cfg Config) *Server {
	if cfg.Burst <= 0 {
		cfg.Burst = DefaultBurst
	}
	if cfg.Every <= 0 {
		cfg.Every = DefaultEvery
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	return &Server{cfg: cfg}
}

// Serve takes v's requests over link until ctx ends, opening the stream
// again whenever it breaks. An agent that serves no requests (an older
// one) is asked again only every minute.
func (s *Server) Serve(ctx context.Context, link Link, v VM) error {
	lim := &limiter{burst: float64(s.cfg.Burst), every: s.cfg.Every, tokens: float64(s.cfg.Burst), last: time.Now()}
	for ctx.Err() == nil {
		err := s.serveOnce(ctx, link, v, lim)
		if ctx.Err() != nil {
			return nil
		}
		wait := time.Second
		if connect.CodeOf(err) == connect.CodeUnimplemented {
			wait = time.Minute
		}
		s.cfg.Log.Debug("guest request stream ended; reopening", "vm", v.Name, "err", err, "in", wait)
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
	}
	return nil
}

func (s *Server) serveOnce(ctx context.Context, link Link, v VM, lim *limiter) error {
	client, done := link.Agent()
	stream, err := client.GuestRequests(ctx, connect.NewRequest(&agentv1.GuestRequestsRequest{}))
	if err != nil {
		return done(ctx, err)
	}
	defer stream.Close()
	for stream.Receive() {
		s.handle(ctx, link, v, lim, stream.Msg())
	}
	return done(ctx, stream.Err())
}

// handle decides, records, carries out and answers one request.
func (s *Server) handle(ctx context.Context, link Link, v VM, lim *limiter, req *agentv1.GuestRequest) {
	rec := audit.GuestRequest{
		Request: protocol.CleanText(req.GetKind(), 64), Name: protocol.CleanText(req.GetName(), 128),
		Note: protocol.CleanText(req.GetNote(), maxNote), UID: req.GetUid(), PID: req.GetPid(),
	}
	answer := &agentv1.GuestAnswer{Id: req.GetId()}
	invalid := check(req)
	switch {
	case invalid != "":
		rec.Outcome, rec.Error = OutcomeInvalid, invalid
	case !lim.allow(time.Now()):
		rec.Outcome, rec.Error = OutcomeRateLimited, fmt.Sprintf("over the rate limit: %d at once, then one per %s", s.cfg.Burst, s.cfg.Every)
	default:
		in := &policy.GuestInput{VM: v.Name, Request: req.GetKind(), Args: map[string]string{"name": req.GetName(), "note": req.GetNote()}}
		d, err := s.cfg.Policies.Decide(recorder.WithSession(ctx, v.Name, v.Session), v.Policy(), in)
		rec.Decision, rec.Rule = d.ID, d.Rule
		switch {
		case err != nil:
			rec.Outcome, rec.Error = OutcomeDenied, err.Error()
		case !d.Allow:
			rec.Outcome, rec.Error = OutcomeDenied, fmt.Sprintf("policy %s, rule %s: %s [decision %s]", d.Policy, d.Rule, d.Reason, d.ID)
		default:
			answer.Allowed = true
			if err := s.cfg.Checkpoint(ctx, v.Name, req.GetName(), req.GetNote()); err != nil {
				rec.Outcome, rec.Error = OutcomeFailed, err.Error()
			} else {
				rec.Outcome, rec.Snapshot = OutcomeDone, req.GetName()
				answer.Done = true
			}
		}
	}
	if rec.Error != "" {
		rec.Error = protocol.CleanText(rec.Error, 1024)
		answer.Reason = rec.Error
	} else {
		answer.Reason = fmt.Sprintf("checkpoint %q taken", rec.Snapshot)
	}
	if err := s.record(ctx, v, rec); err != nil {
		// Nothing the guest asks for happens off the record; a checkpoint
		// already taken is in the log as a snapshot event.
		s.cfg.Log.Error("guest request not recorded", "vm", v.Name, "err", err)
	}
	s.cfg.Log.Info("guest request", "vm", v.Name, "request", rec.Request, "name", rec.Name, "outcome", rec.Outcome, "error", rec.Error)
	client, done := link.Agent()
	actx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err := client.AnswerGuestRequest(actx, connect.NewRequest(answer))
	if err := done(actx, err); err != nil && !errors.Is(err, context.Canceled) {
		s.cfg.Log.Warn("guest request not answered", "vm", v.Name, "id", req.GetId(), "err", err)
	}
}

// check says what is wrong with a request, or "" when nothing is.
func check(req *agentv1.GuestRequest) string {
	switch {
	case req.GetKind() != "checkpoint":
		return fmt.Sprintf("unknown request %q", protocol.CleanText(req.GetKind(), 64))
	case protocol.ValidVMName(req.GetName()) != nil:
		return "a checkpoint's name is 1-63 lower-case letters, digits and '-', starting with a letter"
	case len(req.GetNote()) > maxNote:
		return fmt.Sprintf("a note of %d bytes, over %d", len(req.GetNote()), maxNote)
	}
	return ""
}

func (s *Server) record(ctx context.Context, v VM, rec audit.GuestRequest) error {
	if s.cfg.Audit == nil {
		return nil
	}
	b, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	_, err = s.cfg.Audit.Append(ctx, audit.Record{Kind: audit.KindGuestRequest, VM: v.Name, Session: v.Session, Provenance: audit.Host, Data: b})
	return err
}

// limiter is a token bucket: burst at once, then one per every.
type limiter struct {
	mu     sync.Mutex
	burst  float64
	every  time.Duration
	tokens float64
	last   time.Time
}

func (l *limiter) allow(now time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.tokens = min(l.burst, l.tokens+float64(now.Sub(l.last))/float64(l.every))
	l.last = now
	if l.tokens < 1 {
		return false
	}
	l.tokens--
	return true
}
