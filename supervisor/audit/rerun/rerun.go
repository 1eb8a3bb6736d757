// Package rerun replays a recorded session on a fresh VM: the commands it
// ran and the files written through the API, in their recorded order,
// from the same image digest and policy revision, and reports where the
// outputs differ from the record.
//
// A session is read from the audit log (review.LoadSession); Build turns
// it into a Plan, which Run carries out through carreld's API. What the
// guest did on its own (file.activity) and reads are not replayed: they
// changed nothing the next step depends on, or carrel did not cause them.
package rerun

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/audit/review"
	"github.com/carrel-os/carrel/supervisor/client"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

// MaxCompared caps the recorded output of one stream that a step holds
// for comparison; a longer stream is compared by size and digest only.
const MaxCompared = 64 << 20

// Plan is what a rerun does.
type Plan struct {
	Session        string
	VM             string
	ImageDigest    string
	Policy         string
	PolicyRevision string
	MemoryBytes    uint64
	CPUs           uint32
	// Origin is the snapshot the session started from (a restore or a
	// fork); the rerun forks from it instead of booting.
	Origin *audit.SnapshotRef
	Steps  []Step
	// Skipped names recorded actions a rerun cannot repeat, and why.
	Skipped []string
}

// Step is one recorded action.
type Step struct {
	Seq  uint64 // its intent's seq
	Kind string // "exec" or "write"
	// exec
	Argv  []string
	Env   map[string]string
	Cwd   string
	User  string
	TTY   bool
	Stdin []string // blob digests, in order
	// What the record says it did: nil Code with Signal set for a signal,
	// both empty when it has no outcome.
	Code           *int32
	Signal         string
	Stdout, Stderr []string // blob digests, in order
	// write, and the other file actions
	Path    string
	Mode    uint32
	Content string // blob digest
	Digest  string // of the content written
	// file: Action is "file.mkdir", "file.remove", "file.rename",
	// "file.chmod" or "file.chown"; Failed holds the recorded error.
	Action    string
	To        string
	UID, GID  *int64
	Recursive bool
	Failed    string
}

// Build reads a session's plan from its records.
func Build(s *review.Session) (*Plan, error) {
	p := &Plan{Session: s.ID, VM: s.VM}
	steps := map[uint64]*Step{}
	var order []uint64
	for _, e := range s.Entries {
		r := e.Record
		switch r.Kind {
		case audit.KindVMLifecycle:
			var d audit.Lifecycle
			if json.Unmarshal(r.Data, &d) == nil && p.ImageDigest == "" && d.ImageDigest != "" {
				p.ImageDigest, p.Policy, p.PolicyRevision, p.MemoryBytes, p.CPUs = d.ImageDigest, d.Policy, d.PolicyRevision, d.MemoryBytes, d.CPUs
			}
			if d.Origin != nil && p.Origin == nil {
				p.Origin = d.Origin
			}
		case audit.KindIntent:
			v, err := audit.DecodeIntent(r.Data)
			if err != nil {
				return nil, fmt.Errorf("record %d: %w", r.Seq, err)
			}
			switch d := v.(type) {
			case *audit.ExecIntentTruncated:
				p.Skipped = append(p.Skipped, fmt.Sprintf("record %d: a command too large to record whole", r.Seq))
			case *audit.ExecIntent:
				if d.Detach {
					p.Skipped = append(p.Skipped, fmt.Sprintf("record %d: a detached command (%s)", r.Seq, firstArg(d.Argv)))
					break
				}
				steps[r.Seq] = &Step{Seq: r.Seq, Kind: "exec", Argv: d.Argv, Env: d.Env, Cwd: d.Cwd, User: d.User, TTY: d.TTY}
				order = append(order, r.Seq)
			case *audit.ForwardIntent:
				p.Skipped = append(p.Skipped, fmt.Sprintf("record %d: %s %s is not replayed", r.Seq, d.Action, ""))
			case *audit.InputIntent:
				p.Skipped = append(p.Skipped, fmt.Sprintf("record %d: %s to command %s (input to a running command) is not replayed", r.Seq, d.Input, d.ExecID))
			case *audit.FileIntent:
				switch {
				case d.Action == "file.write" && !d.Tar:
					steps[r.Seq] = &Step{Seq: r.Seq, Kind: "write", Path: d.Path, Mode: d.Mode}
					order = append(order, r.Seq)
				case slices.Contains(fileActions, d.Action):
					steps[r.Seq] = &Step{Seq: r.Seq, Kind: "file", Action: d.Action, Path: d.Path, To: d.To, Mode: d.Mode, UID: d.UID, GID: d.GID, Recursive: d.Recursive}
					order = append(order, r.Seq)
				default:
					p.Skipped = append(p.Skipped, fmt.Sprintf("record %d: %s %s is not replayed", r.Seq, d.Action, d.Path))
				}
			}
		case audit.KindExecOutput:
			var d audit.ExecOutput
			if json.Unmarshal(r.Data, &d) != nil || len(r.Blobs) != 1 {
				continue
			}
			st := steps[d.Exec]
			if st == nil {
				continue
			}
			switch d.Stream {
			case "stdin":
				st.Stdin = append(st.Stdin, r.Blobs[0])
			case "stdout":
				st.Stdout = append(st.Stdout, r.Blobs[0])
			case "stderr":
				st.Stderr = append(st.Stderr, r.Blobs[0])
			}
		case audit.KindExecExit:
			var d audit.ExecExit
			if r.Intent == nil || json.Unmarshal(r.Data, &d) != nil {
				continue
			}
			if st := steps[*r.Intent]; st != nil {
				st.Code, st.Signal = d.Code, d.Signal
			}
		case audit.KindFileOp:
			var d audit.FileOp
			if r.Intent == nil || json.Unmarshal(r.Data, &d) != nil {
				continue
			}
			st := steps[*r.Intent]
			if st == nil {
				continue
			}
			if st.Kind == "file" {
				st.Failed, st.Content = d.Error, "done" // has its outcome
				continue
			}
			switch {
			case d.Error != "":
				// It failed then; it is not repeated.
				delete(steps, *r.Intent)
			case len(r.Blobs) != 1:
				p.Skipped = append(p.Skipped, fmt.Sprintf("record %d: the write of %s (content %s)", *r.Intent, st.Path, d.Content))
				delete(steps, *r.Intent)
			default:
				st.Content, st.Digest = r.Blobs[0], d.Digest
			}
		}
	}
	if p.ImageDigest == "" {
		return nil, fmt.Errorf("session %s has no lifecycle record naming its image", s.ID)
	}
	for _, seq := range order {
		st := steps[seq]
		if st == nil {
			continue
		}
		if st.Kind != "exec" && st.Content == "" {
			p.Skipped = append(p.Skipped, fmt.Sprintf("record %d: %s of %s has no outcome", seq, st.Kind, st.Path))
			continue
		}
		if st.Kind == "file" {
			st.Content = ""
		}
		p.Steps = append(p.Steps, *st)
	}
	return p, nil
}

// fileActions are the file actions a rerun repeats besides writes.
var fileActions = []string{"file.mkdir", "file.remove", "file.rename", "file.chmod", "file.chown"}

func firstArg(argv []string) string {
	if len(argv) == 0 {
		return ""
	}
	return argv[0]
}

// Result is how one step went.
type Result struct {
	Step Step
	// Same is true when everything compared matched.
	Same bool
	// Diffs says what differed, one line each.
	Diffs []string
	Err   error
}

// Options adjust a Run.
type Options struct {
	// VM is the name of the fresh VM; it must not exist.
	VM string
	// Keep leaves the VM running afterwards.
	Keep bool
	// Progress, when set, hears of each result as it comes.
	Progress func(Result)
}

// Run creates a fresh VM from the plan's image and policy (or, for a
// session that started from a snapshot, forks one from that snapshot),
// carries out its steps in order and compares each with the record. The policy bound to
// the plan's name must still have the recorded revision; otherwise Run
// refuses, since decisions might differ.
func Run(ctx context.Context, c *client.Client, dir string, p *Plan, opts Options) ([]Result, error) {
	if err := checkPolicy(ctx, c, p); err != nil {
		return nil, err
	}
	if o := p.Origin; o != nil {
		// The session began at a snapshot's instant, processes and all: a
		// cold boot would not be the same machine.
		_, err := c.VMs.ForkVM(ctx, connect.NewRequest(&apiv1.ForkVMRequest{Name: o.VM, NewName: opts.VM, Snapshot: o.Name}))
		if err != nil {
			return nil, fmt.Errorf("the session started from snapshot %q of %s (session %s); forking the rerun vm %s from it: %w", o.Name, o.VM, o.Session, opts.VM, err)
		}
	} else {
		_, err := c.VMs.CreateVM(ctx, connect.NewRequest(&apiv1.CreateVMRequest{Name: opts.VM, Image: p.ImageDigest,
			MemoryBytes: p.MemoryBytes, Cpus: p.CPUs, Policy: p.Policy}))
		if err != nil {
			return nil, fmt.Errorf("create the rerun vm %s from image %s: %w", opts.VM, p.ImageDigest, err)
		}
	}
	if !opts.Keep {
		defer c.VMs.DeleteVM(context.WithoutCancel(ctx), connect.NewRequest(&apiv1.DeleteVMRequest{Name: opts.VM, Force: true}))
	}
	var results []Result
	for _, st := range p.Steps {
		var r Result
		switch st.Kind {
		case "exec":
			r = runExec(ctx, c, dir, opts.VM, st)
		case "write":
			r = runWrite(ctx, c, dir, opts.VM, st)
		case "file":
			r = runFile(ctx, c, opts.VM, st)
		}
		r.Same = r.Err == nil && len(r.Diffs) == 0
		results = append(results, r)
		if opts.Progress != nil {
			opts.Progress(r)
		}
		if ctx.Err() != nil {
			return results, ctx.Err()
		}
	}
	return results, nil
}

func checkPolicy(ctx context.Context, c *client.Client, p *Plan) error {
	if p.Policy == "" {
		return nil
	}
	resp, err := c.Policies.GetPolicy(ctx, connect.NewRequest(&apiv1.GetPolicyRequest{Name: p.Policy}))
	if err != nil {
		return fmt.Errorf("policy %s: %w", p.Policy, err)
	}
	if rev := resp.Msg.Policy.GetRevision(); p.PolicyRevision != "" && rev != p.PolicyRevision {
		return fmt.Errorf("policy %s is at revision %s, the session ran under %s: apply that revision first (carrel policy apply)", p.Policy, rev, p.PolicyRevision)
	}
	return nil
}

// blobReader reads the concatenation of blobs.
func blobReader(dir string, digests []string) (io.Reader, func(), error) {
	var rs []io.Reader
	var fs []*os.File
	closeAll := func() {
		for _, f := range fs {
			f.Close()
		}
	}
	for _, d := range digests {
		path, err := audit.BlobPath(dir, d)
		if err != nil {
			closeAll()
			return nil, nil, err
		}
		f, err := os.Open(path)
		if err != nil {
			closeAll()
			return nil, nil, fmt.Errorf("blob %s: %w", d, err)
		}
		fs = append(fs, f)
		rs = append(rs, f)
	}
	return io.MultiReader(rs...), closeAll, nil
}

// recorded returns a stream's recorded bytes, up to MaxCompared.
func recorded(dir string, digests []string) ([]byte, bool, error) {
	r, done, err := blobReader(dir, digests)
	if err != nil {
		return nil, false, err
	}
	defer done()
	b, err := io.ReadAll(io.LimitReader(r, MaxCompared+1))
	return b, len(b) > MaxCompared, err
}

// capped is a writer that keeps at most MaxCompared bytes and counts the
// rest.
type capped struct {
	buf bytes.Buffer
	n   int64
}

func (w *capped) Write(p []byte) (int, error) {
	w.n += int64(len(p))
	if room := MaxCompared - w.buf.Len(); room > 0 {
		w.buf.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}

func runExec(ctx context.Context, c *client.Client, dir, vm string, st Step) Result {
	r := Result{Step: st}
	var env []string
	for k, v := range st.Env {
		env = append(env, k+"="+v)
	}
	slices.Sort(env)
	req := &agentv1.ExecRequest{Argv: st.Argv, Env: env, Cwd: st.Cwd, User: st.User, Tty: st.TTY}
	stdin, done, err := blobReader(dir, st.Stdin)
	if err != nil {
		r.Err = err
		return r
	}
	defer done()
	var stdout, stderr capped
	exit, err := c.Run(ctx, client.Session{VM: vm, Start: req, Stdin: stdin, Stdout: &stdout, Stderr: &stderr})
	if err != nil {
		r.Err = err
		return r
	}
	switch {
	case st.Code == nil && st.Signal == "":
		r.Diffs = append(r.Diffs, "the record has no exit status for this command")
	case st.Signal != exit.Signal || (st.Code != nil && *st.Code != exit.Code):
		r.Diffs = append(r.Diffs, fmt.Sprintf("exit: recorded %s, now %s", exitText(st.Code, st.Signal), exitText(&exit.Code, exit.Signal)))
	}
	for _, s := range []struct {
		name    string
		digests []string
		got     *capped
	}{{"stdout", st.Stdout, &stdout}, {"stderr", st.Stderr, &stderr}} {
		want, over, err := recorded(dir, s.digests)
		if err != nil {
			r.Diffs = append(r.Diffs, fmt.Sprintf("%s: the recorded output cannot be read: %v", s.name, err))
			continue
		}
		if over || s.got.n > MaxCompared {
			r.Diffs = append(r.Diffs, fmt.Sprintf("%s: over %d MiB, not compared", s.name, MaxCompared>>20))
			continue
		}
		if d := firstDiff(want, s.got.buf.Bytes()); d != "" {
			r.Diffs = append(r.Diffs, s.name+": "+d)
		}
	}
	return r
}

func exitText(code *int32, signal string) string {
	if signal != "" {
		return "signal " + signal
	}
	if code == nil {
		return "none"
	}
	return fmt.Sprintf("code %d", *code)
}

func runWrite(ctx context.Context, c *client.Client, dir, vm string, st Step) Result {
	r := Result{Step: st}
	content, done, err := blobReader(dir, []string{st.Content})
	if err != nil {
		r.Err = err
		return r
	}
	defer done()
	resp, err := c.Upload(ctx, vm, st.Path, content, st.Mode)
	if err != nil {
		r.Err = err
		return r
	}
	if resp.Digest != st.Digest {
		r.Diffs = append(r.Diffs, fmt.Sprintf("content digest: recorded %s, written %s", st.Digest, resp.Digest))
	}
	return r
}

// runFile repeats a file action; it should succeed or fail as it did.
func runFile(ctx context.Context, c *client.Client, vm string, st Step) Result {
	r := Result{Step: st}
	var err error
	switch st.Action {
	case "file.mkdir":
		_, err = c.Files.MakeDir(ctx, client.ForVM(vm, &agentv1.MakeDirRequest{Path: st.Path, Parents: st.Recursive, Mode: st.Mode}))
	case "file.remove":
		_, err = c.Files.Remove(ctx, client.ForVM(vm, &agentv1.RemoveRequest{Path: st.Path, Recursive: st.Recursive}))
	case "file.rename":
		_, err = c.Files.Rename(ctx, client.ForVM(vm, &agentv1.RenameRequest{From: st.Path, To: st.To}))
	case "file.chmod":
		_, err = c.Files.Chmod(ctx, client.ForVM(vm, &agentv1.ChmodRequest{Path: st.Path, Mode: st.Mode}))
	case "file.chown":
		if st.UID == nil || st.GID == nil {
			r.Err = errors.New("the record lacks the uid or gid")
			return r
		}
		_, err = c.Files.Chown(ctx, client.ForVM(vm, &agentv1.ChownRequest{Path: st.Path, Uid: *st.UID, Gid: *st.GID}))
	}
	switch {
	case err != nil && st.Failed == "":
		r.Diffs = append(r.Diffs, "failed now, succeeded then: "+err.Error())
	case err == nil && st.Failed != "":
		r.Diffs = append(r.Diffs, "succeeded now, failed then: "+st.Failed)
	}
	return r
}

// firstDiff describes where got first differs from want, or "" when they
// are equal.
func firstDiff(want, got []byte) string {
	if bytes.Equal(want, got) {
		return ""
	}
	line := 1
	for i := 0; i < len(want) && i < len(got); i++ {
		if want[i] != got[i] {
			return fmt.Sprintf("differs at byte %d (line %d): recorded %q, now %q", i, line, excerpt(want[i:]), excerpt(got[i:]))
		}
		if want[i] == '\n' {
			line++
		}
	}
	return fmt.Sprintf("recorded %d bytes, now %d (one is a prefix of the other)", len(want), len(got))
}

func excerpt(b []byte) string {
	if i := bytes.IndexByte(b, '\n'); i >= 0 && i < 60 {
		return string(b[:i])
	}
	return string(b[:min(len(b), 60)])
}

// ErrDiffers is returned by the CLI when a rerun's outputs differ.
var ErrDiffers = errors.New("the rerun differs from the record")
