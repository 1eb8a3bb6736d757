package api

import (
	"context"
	"errors"
	"time"
	"unicode/utf8"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/audit/review"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

// Bounds on what GetConsole and ListAuditRecords return, and on what
// ListAuditRecords reads: a call costs the same however long the log.
const (
	defaultConsoleBytes = 64 << 10
	maxConsoleBytes     = 1 << 20
	defaultAuditRecords = 100
	maxAuditRecords     = 1000
	auditReadBack       = 64 << 20
	maxSummary          = 2 << 10
)

func (s *vmService) GetConsole(ctx context.Context, req *connect.Request[apiv1.GetConsoleRequest]) (*connect.Response[apiv1.GetConsoleResponse], error) {
	n := int64(req.Msg.MaxBytes)
	if n == 0 {
		n = defaultConsoleBytes
	}
	data, more, err := s.cfg.Manager.Console(req.Msg.Name, min(n, maxConsoleBytes))
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&apiv1.GetConsoleResponse{Data: data, Truncated: more}), nil
}

func (s *vmService) ListAuditRecords(ctx context.Context, req *connect.Request[apiv1.ListAuditRecordsRequest]) (*connect.Response[apiv1.ListAuditRecordsResponse], error) {
	if s.cfg.AuditDir == "" {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("this carreld keeps no audit log"))
	}
	if _, err := s.cfg.Manager.Get(req.Msg.Name); err != nil {
		return nil, toConnect(err)
	}
	n := int(req.Msg.Limit)
	if n == 0 {
		n = defaultAuditRecords
	}
	r, err := audit.OpenReader(s.cfg.AuditDir)
	if err != nil {
		return nil, toConnect(err)
	}
	defer r.Close()
	resp := &apiv1.ListAuditRecordsResponse{}
	resp.Partial, err = review.RecentVM(r, req.Msg.Name, min(n, maxAuditRecords), auditReadBack, func(e review.Entry) error {
		summary := review.Summary(&e)
		if len(summary) > maxSummary {
			summary = cutUTF8(summary, maxSummary) + "…"
		}
		resp.Records = append(resp.Records, &apiv1.AuditRecord{
			Seq: e.Seq, Time: e.Time.UTC().Format(time.RFC3339Nano), Kind: e.Kind, Provenance: string(e.Provenance), Session: e.Session, Summary: summary,
		})
		return nil
	})
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(resp), nil
}

// cutUTF8 is s cut to at most n bytes, not inside a character.
func cutUTF8(s string, n int) string {
	for n > 0 && n < len(s) && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:min(n, len(s))]
}
