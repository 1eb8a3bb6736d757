package e2b

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/supervisor/client"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

// DefaultTemplate is the template a create that names none gets, as in
// the SDKs ("base"); an operator tags the image to serve it.
const DefaultTemplate = "base"

// DefaultTimeout is the time to live, in seconds, of a sandbox whose
// create gives none (as e2b's API: 300 s); a sandbox always has one.
const DefaultTimeout = 300

// labelTemplate keeps a sandbox's template among its VM's labels; the
// rest of them are the sandbox's metadata.
const labelTemplate = "e2b.template"

// newSandbox is the body of a create: the fields carrel uses. Others
// (network, volume mounts, MCP) are accepted and ignored: a VM reaches
// only what its policy lets it (docs/agents.md lists the gaps).
type newSandbox struct {
	TemplateID string            `json:"templateID"`
	Timeout    *int64            `json:"timeout"`
	EnvVars    map[string]string `json:"envVars"`
	Metadata   map[string]string `json:"metadata"`
	AutoPause  bool              `json:"autoPause"`
}

// sandbox is the reply to a create or a connect.
type sandbox struct {
	SandboxID       string  `json:"sandboxID"`
	TemplateID      string  `json:"templateID"`
	ClientID        string  `json:"clientID"`
	EnvdVersion     string  `json:"envdVersion"`
	EnvdAccessToken string  `json:"envdAccessToken"`
	Domain          *string `json:"domain"`
}

// sandboxDetail is what get and list give.
type sandboxDetail struct {
	SandboxID   string            `json:"sandboxID"`
	TemplateID  string            `json:"templateID"`
	ClientID    string            `json:"clientID"`
	StartedAt   string            `json:"startedAt"`
	EndAt       string            `json:"endAt"`
	EnvdVersion string            `json:"envdVersion"`
	CPUCount    uint32            `json:"cpuCount"`
	MemoryMB    uint64            `json:"memoryMB"`
	DiskSizeMB  uint64            `json:"diskSizeMB"`
	Metadata    map[string]string `json:"metadata"`
	State       string            `json:"state"`
}

// clientID is what carrel reports as the host a sandbox runs on.
const clientID = "carrel"

func (s *server) create(w http.ResponseWriter, r *http.Request, c call) {
	var body newSandbox
	if err := decodeJSON(r, &body); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	tmpl := body.TemplateID
	if tmpl == "" {
		tmpl = DefaultTemplate
	}
	labels := map[string]string{}
	for k, v := range body.Metadata {
		if strings.HasPrefix(k, "e2b.") {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("metadata key %q: keys beginning e2b. are carrel's", clip(k)))
			return
		}
		labels[k] = v
	}
	labels[labelTemplate] = tmpl
	env := make([]string, 0, len(body.EnvVars))
	for k, v := range body.EnvVars {
		env = append(env, k+"="+v)
	}
	sort.Strings(env)
	req := &apiv1.CreateVMRequest{
		Name: newSandboxID(c.key.Key.Name), Image: tmpl, Policy: c.key.Key.Policy,
		Env: env, Labels: labels, ExpiryAction: apiv1.ExpiryAction_EXPIRY_ACTION_DELETE,
	}
	if body.AutoPause {
		req.ExpiryAction = apiv1.ExpiryAction_EXPIRY_ACTION_STOP
	}
	req.TtlSeconds = DefaultTimeout
	if body.Timeout != nil {
		if *body.Timeout <= 0 {
			writeError(w, http.StatusBadRequest, "timeout must be a positive number of seconds")
			return
		}
		req.TtlSeconds = uint64(*body.Timeout)
	}
	resp, err := s.c.VMs.CreateVM(r.Context(), connect.NewRequest(req))
	if err != nil {
		if connect.CodeOf(err) == connect.CodeNotFound {
			writeError(w, http.StatusNotFound, fmt.Sprintf("template %q not found: %s", clip(tmpl), message(err)))
			return
		}
		writeCarrelError(w, err)
		return
	}
	writeJSON(w, http.StatusCreated, s.sandboxReply(c, resp.Msg.Vm))
}

func (s *server) sandboxReply(c call, vm *apiv1.VM) sandbox {
	return sandbox{
		SandboxID: vm.Name, TemplateID: vm.Labels[labelTemplate], ClientID: clientID,
		EnvdVersion: EnvdVersion, EnvdAccessToken: s.cfg.Tokens.SandboxToken(c.key.ID, vm.Name),
	}
}

func detail(vm *apiv1.VM) sandboxDetail {
	d := sandboxDetail{
		SandboxID: vm.Name, TemplateID: vm.Labels[labelTemplate], ClientID: clientID,
		StartedAt: vm.CreatedAt, EndAt: vm.ExpiresAt, EnvdVersion: EnvdVersion,
		CPUCount: vm.Cpus, MemoryMB: vm.MemoryBytes >> 20, DiskSizeMB: vm.DiskBytes >> 20,
		Metadata: map[string]string{}, State: "running",
	}
	if d.EndAt == "" {
		d.EndAt = vm.CreatedAt // no end: say so by the start, as a time is required
	}
	for k, v := range vm.Labels {
		if k != labelTemplate {
			d.Metadata[k] = v
		}
	}
	if vm.State != apiv1.VMState_VM_STATE_RUNNING {
		d.State = "paused"
	}
	return d
}

// list lists the key's sandboxes: ?metadata=k%3Dv%26k2%3Dv2 filters by
// metadata, ?state=running,paused by state; ?limit and ?nextToken page.
func (s *server) list(w http.ResponseWriter, r *http.Request, c call) {
	q := r.URL.Query()
	want := map[string]string{}
	if m := q.Get("metadata"); m != "" {
		pairs, err := url.ParseQuery(m)
		if err != nil {
			writeError(w, http.StatusBadRequest, "metadata: "+err.Error())
			return
		}
		for k, vs := range pairs {
			want[k] = vs[0]
		}
	}
	var states []string
	for _, st := range q["state"] {
		states = append(states, strings.Split(st, ",")...)
	}
	limit := 100
	if l := q.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 1 || n > 1000 {
			writeError(w, http.StatusBadRequest, "limit must be 1 to 1000")
			return
		}
		limit = n
	}
	resp, err := s.c.VMs.ListVMs(r.Context(), connect.NewRequest(&apiv1.ListVMsRequest{Labels: want}))
	if err != nil {
		writeCarrelError(w, err)
		return
	}
	var out []sandboxDetail
	for _, vm := range resp.Msg.Vms { // in name order
		d := detail(vm)
		if len(states) > 0 && !slices.Contains(states, d.State) {
			continue
		}
		if next := q.Get("nextToken"); next != "" && vm.Name <= next {
			continue
		}
		if len(out) == limit {
			w.Header().Set("X-Next-Token", out[len(out)-1].SandboxID)
			break
		}
		out = append(out, d)
	}
	if out == nil {
		out = []sandboxDetail{}
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *server) info(w http.ResponseWriter, r *http.Request, c call) {
	vm, err := s.getVM(r.Context(), c.vm)
	if err != nil {
		writeCarrelError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, detail(vm))
}

func (s *server) getVM(ctx context.Context, name string) (*apiv1.VM, error) {
	resp, err := s.c.VMs.GetVM(ctx, client.ForVM(name, &apiv1.GetVMRequest{Name: name}))
	if err != nil {
		return nil, notFound(err, name)
	}
	return resp.Msg.Vm, nil
}

// notFound words a missing sandbox as e2b does.
func notFound(err error, name string) error {
	if connect.CodeOf(err) == connect.CodeNotFound {
		return connect.NewError(connect.CodeNotFound, fmt.Errorf("sandbox %s not found", name))
	}
	return err
}

func (s *server) kill(w http.ResponseWriter, r *http.Request, c call) {
	_, err := s.c.VMs.DeleteVM(r.Context(), connect.NewRequest(&apiv1.DeleteVMRequest{Name: c.vm, Force: true}))
	if err != nil {
		writeCarrelError(w, notFound(err, c.vm))
		return
	}
	s.procs.forget(c.vm)
	w.WriteHeader(http.StatusNoContent)
}

type timeoutBody struct {
	Timeout *int64 `json:"timeout"`
}

func (s *server) setTimeout(w http.ResponseWriter, r *http.Request, c call) {
	var body timeoutBody
	if err := decodeJSON(r, &body); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if body.Timeout == nil || *body.Timeout < 0 {
		writeError(w, http.StatusBadRequest, "timeout (seconds, 0 or more) is required")
		return
	}
	if err := s.setExpiry(r.Context(), c.vm, uint64(*body.Timeout)); err != nil {
		writeCarrelError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *server) setExpiry(ctx context.Context, name string, seconds uint64) error {
	_, err := s.c.VMs.SetVMExpiry(ctx, connect.NewRequest(&apiv1.SetVMExpiryRequest{Name: name, TtlSeconds: seconds}))
	return notFound(err, name)
}

// pauseSnapshot is the snapshot a pause that keeps memory takes of its
// sandbox; connect restores it, then deletes it.
const pauseSnapshot = "e2b-paused"

// pauseBody is a pause's body: memory false asks for e2b's file-system
// pause (a reboot at resume); otherwise the memory is kept.
type pauseBody struct {
	Memory *bool `json:"memory"`
}

// pause ends the sandbox's run. By default it keeps its memory: a carrel
// snapshot of the running VM (memory, devices, disks) is taken, then the
// VM is stopped, and connect restores it, processes and all. With
// memory false it only stops the VM (its disks and /workspace stay). A
// paused sandbox does not expire.
func (s *server) pause(w http.ResponseWriter, r *http.Request, c call) {
	var body pauseBody
	if err := decodeJSON(r, &body); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	ctx := r.Context()
	vm, err := s.getVM(ctx, c.vm)
	if err != nil {
		writeCarrelError(w, err)
		return
	}
	if vm.State == apiv1.VMState_VM_STATE_STOPPED {
		writeError(w, http.StatusConflict, "sandbox "+c.vm+" is already paused")
		return
	}
	// A snapshot of an earlier pause must not be what the next connect
	// restores.
	if err := s.dropPauseSnapshot(ctx, c.vm); err != nil {
		writeCarrelError(w, err)
		return
	}
	keep := body.Memory == nil || *body.Memory
	if keep {
		_, err := s.c.VMs.SnapshotVM(ctx, connect.NewRequest(&apiv1.SnapshotVMRequest{Name: c.vm, Snapshot: pauseSnapshot, Note: "e2b pause"}))
		if err != nil {
			writeCarrelError(w, notFound(err, c.vm))
			return
		}
	}
	// With the memory saved, what the VM does after it is thrown away at
	// the restore: it may as well be stopped at once.
	if _, err := s.c.VMs.StopVM(ctx, connect.NewRequest(&apiv1.StopVMRequest{Name: c.vm, Force: keep})); err != nil {
		writeCarrelError(w, notFound(err, c.vm))
		return
	}
	s.procs.forget(c.vm)
	if err := s.setExpiry(ctx, c.vm, 0); err != nil {
		writeCarrelError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// dropPauseSnapshot deletes the pause snapshot of vm, if it has one.
func (s *server) dropPauseSnapshot(ctx context.Context, vm string) error {
	list, err := s.c.VMs.ListSnapshots(ctx, connect.NewRequest(&apiv1.ListSnapshotsRequest{Name: vm}))
	if err != nil {
		return notFound(err, vm)
	}
	for _, snap := range list.Msg.Snapshots {
		if snap.Name == pauseSnapshot {
			_, err := s.c.VMs.DeleteSnapshot(ctx, connect.NewRequest(&apiv1.DeleteSnapshotRequest{Name: vm, Snapshot: pauseSnapshot}))
			return err
		}
	}
	return nil
}

// connect resumes a paused sandbox and sets its time-out when asked: 201
// when it was resumed, 200 when it was running. A sandbox paused with its
// memory is restored from its pause snapshot, which is then deleted; one
// paused without boots again. memory false (the SDK's onResume
// "reboot") boots it again either way.
func (s *server) connect(w http.ResponseWriter, r *http.Request, c call) {
	var body struct {
		Timeout *int64 `json:"timeout"`
		Memory  *bool  `json:"memory"`
	}
	if err := decodeJSON(r, &body); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if body.Timeout != nil && *body.Timeout < 0 {
		writeError(w, http.StatusBadRequest, "timeout must not be negative")
		return
	}
	ctx := r.Context()
	vm, err := s.getVM(ctx, c.vm)
	if err != nil {
		writeCarrelError(w, err)
		return
	}
	status := http.StatusOK
	if vm.State == apiv1.VMState_VM_STATE_STOPPED {
		vm, err = s.resume(ctx, c.vm, body.Memory == nil || *body.Memory)
		if err != nil {
			writeCarrelError(w, notFound(err, c.vm))
			return
		}
		status = http.StatusCreated
	}
	if body.Timeout != nil {
		if err := s.setExpiry(ctx, c.vm, uint64(*body.Timeout)); err != nil {
			writeCarrelError(w, err)
			return
		}
	}
	writeJSON(w, status, s.sandboxReply(c, vm))
}

// resume starts a paused sandbox: from its pause snapshot when it has one
// and memory is wanted, else by booting it.
func (s *server) resume(ctx context.Context, name string, memory bool) (*apiv1.VM, error) {
	list, err := s.c.VMs.ListSnapshots(ctx, connect.NewRequest(&apiv1.ListSnapshotsRequest{Name: name}))
	if err != nil {
		return nil, err
	}
	if memory && slices.ContainsFunc(list.Msg.Snapshots, func(sn *apiv1.Snapshot) bool { return sn.Name == pauseSnapshot }) {
		resp, err := s.c.VMs.RestoreVM(ctx, connect.NewRequest(&apiv1.RestoreVMRequest{Name: name, Snapshot: pauseSnapshot}))
		if err != nil {
			return nil, err
		}
		// The restored run stands on the snapshot's layers, which carreld
		// keeps while they are in use: deleting it frees only its record
		// and saved memory.
		if err := s.dropPauseSnapshot(ctx, name); err != nil {
			s.log.Warn("e2b: pause snapshot not deleted after the resume", "vm", name, "err", err)
		}
		return resp.Msg.Vm, nil
	}
	if err := s.dropPauseSnapshot(ctx, name); err != nil {
		return nil, err
	}
	resp, err := s.c.VMs.StartVM(ctx, connect.NewRequest(&apiv1.StartVMRequest{Name: name}))
	if err != nil {
		return nil, err
	}
	return resp.Msg.Vm, nil
}

// decodeJSON reads a JSON body of at most maxJSONBody bytes; an empty
// body is an empty object.
func decodeJSON(r *http.Request, v any) error {
	b, err := io.ReadAll(io.LimitReader(r.Body, maxJSONBody+1))
	if err != nil {
		return fmt.Errorf("read the body: %w", err)
	}
	if len(b) > maxJSONBody {
		return fmt.Errorf("the body is over %d bytes", maxJSONBody)
	}
	if len(strings.TrimSpace(string(b))) == 0 {
		return nil
	}
	if err := json.Unmarshal(b, v); err != nil {
		var se *json.SyntaxError
		if errors.As(err, &se) {
			return fmt.Errorf("malformed JSON at byte %d: %w", se.Offset, err)
		}
		return fmt.Errorf("malformed JSON: %w", err)
	}
	return nil
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
