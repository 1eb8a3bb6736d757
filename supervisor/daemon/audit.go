package daemon

import (
	"context"
	"encoding/json"
	"log/slog"

	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/supervisor/audit"
)

// maxRecordedInput is the largest input document kept whole in a decision
// record; a larger one (a huge argv) is kept as its digest only.
const maxRecordedInput = 32 << 10

// decisionRecorder makes policy decisions durable in the audit log before
// the action they admit goes ahead.
type decisionRecorder struct {
	log *audit.Log
}

type decisionData struct {
	policy.Decision
	Input json.RawMessage `json:"input,omitempty"`
}

func (r decisionRecorder) record(ctx context.Context, d policy.Decision, in policy.Input) error {
	data := decisionData{Decision: d}
	if len(d.Input) <= maxRecordedInput {
		data.Input = d.Input
	}
	b, err := json.Marshal(data)
	if err != nil {
		return err
	}
	_, err = r.log.Append(ctx, audit.Record{Kind: audit.KindPolicyDecision, VM: d.VM, Provenance: audit.Host, Data: b})
	return err
}

// openAudit opens (or recovers) the audit log under the state directory.
func openAudit(dir string, log *slog.Logger) (*audit.Log, error) {
	l, err := audit.Open(dir, audit.Options{
		Logger: log,
		OnFault: func(err error) {
			log.Error("audit log unavailable: every call is refused until it can be written again", "err", err)
		},
		OnRecover: func() { log.Info("audit log writable again") },
	})
	if err != nil {
		return nil, err
	}
	if r := l.Recovered(); r.TruncatedBytes > 0 || len(r.UnknownOutcomes) > 0 {
		log.Warn("audit log recovered", "truncated_bytes", r.TruncatedBytes, "reason", r.TailReason, "unknown_outcomes", len(r.UnknownOutcomes))
	}
	log.Info("audit log open", "dir", dir, "records", l.Size(), "key", l.PublicKey())
	return l, nil
}
