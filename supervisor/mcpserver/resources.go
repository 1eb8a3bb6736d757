package mcpserver

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/carrel-os/carrel/supervisor/audit/review"
	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/supervisor/console"
	"github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

// Bounds on the resources, so that reading one does not flood the
// agent's context.
const (
	// ConsoleBytes is how much of the end of the console log the console
	// resource holds.
	ConsoleBytes = 64 << 10
	// AuditRecords is how many of the VM's last audit records the audit
	// resource holds.
	AuditRecords = 200
)

// The resources of a VM: carrel://vm/NAME/audit and carrel://vm/NAME/console.
const (
	auditResource   = "audit"
	consoleResource = "console"
)

// ResourceURI is the URI of a VM's resource (audit or console).
func ResourceURI(vm, resource string) string {
	return "carrel://vm/" + vm + "/" + resource
}

// addResources adds a VM's audit timeline and console, read from carreld
// as the server's caller, so that the VM's policy decides them as it does
// the tools. A server scoped to one VM lists that VM's two resources (and
// serves no other's); one without a scope offers them as templates.
func addResources(s *mcp.Server, t *tools) {
	audit := "The VM's last " + fmt.Sprint(AuditRecords) + " audit records, oldest first, one a line as `carrel audit show` prints them: " +
		"time (UTC), seq, kind, provenance (host: carreld saw it; guest: the VM's agent reported it), session and a summary " +
		"(each command with its exit, each file operation, each policy decision with its rule and reason)."
	cons := "The end of the VM's serial console log (its last 64 KiB, across its boots): the kernel's messages and what else the guest printed there, " +
		"escape sequences and other control characters taken out."
	if t.vm != "" {
		s.AddResource(&mcp.Resource{URI: ResourceURI(t.vm, auditResource), Name: auditResource, Title: "Audit timeline of " + t.vm,
			Description: audit, MIMEType: "text/plain"}, t.readAudit)
		s.AddResource(&mcp.Resource{URI: ResourceURI(t.vm, consoleResource), Name: consoleResource, Title: "Serial console of " + t.vm,
			Description: cons, MIMEType: "text/plain"}, t.readConsole)
		return
	}
	s.AddResourceTemplate(&mcp.ResourceTemplate{URITemplate: ResourceURI("{name}", auditResource), Name: auditResource, Title: "A VM's audit timeline",
		Description: audit, MIMEType: "text/plain"}, t.readAudit)
	s.AddResourceTemplate(&mcp.ResourceTemplate{URITemplate: ResourceURI("{name}", consoleResource), Name: consoleResource, Title: "A VM's serial console",
		Description: cons, MIMEType: "text/plain"}, t.readConsole)
}

// resourceVM is the VM a resource URI names, if it is one of this
// server's: carrel://vm/NAME/want.
func (t *tools) resourceVM(uri, want string) (string, bool) {
	u, err := url.Parse(uri)
	if err != nil || u.Scheme != "carrel" || u.Host != "vm" || u.RawQuery != "" || u.Fragment != "" {
		return "", false
	}
	vm, res, ok := strings.Cut(strings.TrimPrefix(u.Path, "/"), "/")
	if !ok || res != want || client.ValidVMName(vm) != nil || (t.vm != "" && vm != t.vm) {
		return "", false
	}
	return vm, true
}

// readError is carreld's error for a resource: not found, or its words.
func readError(uri string, err error) error {
	if connect.CodeOf(err) == connect.CodeNotFound {
		return mcp.ResourceNotFoundError(uri)
	}
	return explain(err)
}

// auditTime is the timestamps' layout in `carrel audit show`.
const auditTime = "2006-01-02T15:04:05.000Z"

func (t *tools) readAudit(ctx context.Context, req *mcp.ReadResourceRequest) (*mcp.ReadResourceResult, error) {
	uri := req.Params.URI
	vm, ok := t.resourceVM(uri, auditResource)
	if !ok {
		return nil, mcp.ResourceNotFoundError(uri)
	}
	resp, err := t.c.VMs.ListAuditRecords(ctx, connect.NewRequest(&apiv1.ListAuditRecordsRequest{Name: vm, Limit: AuditRecords}))
	if err != nil {
		return nil, readError(uri, err)
	}
	return textResource(uri, auditTimeline(resp.Msg)), nil
}

// auditTimeline is the records as `carrel audit show VM` prints them.
func auditTimeline(m *apiv1.ListAuditRecordsResponse) string {
	var b strings.Builder
	b.WriteString(review.TimelineHeader(true) + "\n")
	for _, r := range m.Records {
		when := r.Time
		if tm, err := time.Parse(time.RFC3339Nano, r.Time); err == nil {
			when = tm.UTC().Format(auditTime)
		}
		session := r.Session
		if session == "" {
			session = "-"
		}
		line := fmt.Sprintf("%s %7d  %-16s %-5s %-20s %s", when, r.Seq, r.Kind, r.Provenance, session, r.Summary)
		b.WriteString(strings.TrimRight(line, " ") + "\n")
	}
	if m.Partial {
		b.WriteString("(earlier records were not looked for: the end of the log that carreld reads holds no more of this VM's; carrel audit show reads it all)\n")
	}
	return b.String()
}

func (t *tools) readConsole(ctx context.Context, req *mcp.ReadResourceRequest) (*mcp.ReadResourceResult, error) {
	uri := req.Params.URI
	vm, ok := t.resourceVM(uri, consoleResource)
	if !ok {
		return nil, mcp.ResourceNotFoundError(uri)
	}
	resp, err := t.c.VMs.GetConsole(ctx, connect.NewRequest(&apiv1.GetConsoleRequest{Name: vm, MaxBytes: ConsoleBytes}))
	if err != nil {
		return nil, readError(uri, err)
	}
	text := console.Printable(resp.Msg.Data)
	switch {
	case resp.Msg.Truncated:
		text = fmt.Sprintf("(the last %d bytes of the console log)\n", len(resp.Msg.Data)) + text
	case text == "":
		text = "(the console log is empty)\n"
	}
	return textResource(uri, text), nil
}

func textResource(uri, text string) *mcp.ReadResourceResult {
	return &mcp.ReadResourceResult{Contents: []*mcp.ResourceContents{{URI: uri, MIMEType: "text/plain", Text: text}}}
}
