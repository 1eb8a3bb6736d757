package recorder

import (
	"context"
	"encoding/json"
	"time"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/audit"
)

// APICall is one call to carreld's API, for its "api.call" record once
// it ends. The API's interceptor fills in the caller, the VM and the
// decision as it authorizes the call.
type APICall struct {
	audit.APICall
	// VM is the VM the call named, if any; Session its run then.
	VM, Session string
	start       time.Time
}

// NewAPICall starts timing a call to procedure.
func NewAPICall(procedure string) *APICall {
	return &APICall{APICall: audit.APICall{Procedure: procedure}, start: time.Now()}
}

// APICallEnded records a call once it has ended, before its reply (or
// its stream's end) reaches the caller, with code the connect code its
// error maps to ("ok" for none). Its admission is already on record (the
// api decision); a failure here is logged. The records the call held
// back (Hold) are written with it.
func (r *Recorder) APICallEnded(ctx context.Context, c *APICall, code string, err error) {
	if r == nil {
		return
	}
	c.DurationNs = time.Since(c.start).Nanoseconds()
	c.Code = code
	if err != nil {
		c.Error = protocol.CleanText(err.Error(), 1024)
	}
	data, merr := json.Marshal(c.APICall)
	if merr != nil {
		return
	}
	rec := audit.Record{Kind: audit.KindAPICall, VM: c.VM, Session: c.Session, Provenance: audit.Host, Data: data}
	// What the call held back (a command's outcome, a denied decision)
	// shares this record's group commit.
	recs := append(takeHeld(ctx), rec)
	if _, err := r.log.AppendAll(context.WithoutCancel(ctx), recs...); err != nil {
		// An outcome among recs is kept by the log, and written once
		// it can write again (audit.Log's deferred outcomes).
		r.logger.Error("api call not recorded", "procedure", c.Procedure, "records", len(recs), "err", err)
	}
}
