package mcpserver

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"connectrpc.com/connect"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

// maxMatches caps search_files.
const maxMatches = 1000

// addMore adds the tools beyond files and commands: search, the VM's
// lifecycle and its snapshots. Each is refused by carreld when the caller
// may not (a token reaches none of vm_create, vm_remove or the snapshot
// tools unless its classes say so).
func addMore(s *mcp.Server, t *tools) {
	mcp.AddTool(s, &mcp.Tool{Name: "search_files", Description: "Search the VM's files, in the guest (find, and grep -E): by name (a glob such as *.go), by content (an extended regular expression), or both. " +
		"Returns at most 1000 matches."}, t.searchFiles)
	mcp.AddTool(s, &mcp.Tool{Name: "port_forward", Description: "Forward a port on the host's loopback to a port in the VM (action start), list the forwards (list), or stop one (stop). " +
		"Each connection is decided by the VM's policy; the forwards end with this MCP server's process."}, t.portForward)
	mcp.AddTool(s, &mcp.Tool{Name: "snapshot", Description: "Save the VM at this instant (memory, devices and disks) as a named snapshot."}, t.snapshot)
	mcp.AddTool(s, &mcp.Tool{Name: "restore", Description: "Put the VM back at a snapshot, processes and all; what it did since is gone."}, t.restore)
	mcp.AddTool(s, &mcp.Tool{Name: "fork", Description: "Make a second, independent VM from a snapshot of this one (one taken now when none is named)."}, t.fork)
	if t.vm == "" {
		mcp.AddTool(s, &mcp.Tool{Name: "vm_create", Description: "Create and boot a VM from an image."}, t.vmCreate)
		mcp.AddTool(s, &mcp.Tool{Name: "vm_remove", Description: "Stop and remove a VM, its disks and snapshots."}, t.vmRemove)
	}
}

// SearchIn is search_files' input.
type SearchIn struct {
	VMArg
	Path    string `json:"path" jsonschema:"the directory to search, an absolute path in the VM"`
	Name    string `json:"name,omitempty" jsonschema:"a file name glob, e.g. *.py"`
	Content string `json:"content,omitempty" jsonschema:"an extended regular expression to find in the files' text"`
}

// Match is one file, or one line of one, that matched.
type Match struct {
	Path string `json:"path"`
	Line int    `json:"line,omitempty"`
	Text string `json:"text,omitempty"`
}

// SearchOut is search_files' output.
type SearchOut struct {
	Matches   []Match `json:"matches"`
	Truncated bool    `json:"truncated,omitempty" jsonschema:"there were more than 1000 matches"`
}

func (t *tools) searchFiles(ctx context.Context, _ *mcp.CallToolRequest, in SearchIn) (*mcp.CallToolResult, SearchOut, error) {
	vm, err := t.target(in.VMArg)
	if err != nil {
		return nil, SearchOut{}, err
	}
	if !strings.HasPrefix(in.Path, "/") || (in.Name == "" && in.Content == "") {
		return nil, SearchOut{}, errors.New("give an absolute path, and a name glob, a content pattern or both")
	}
	// Run in the guest as an ordinary command (the policy decides it), with
	// the arguments as argv: nothing is a shell's to interpret (the pattern
	// reaches grep through the environment, since find reads "{}" in its
	// arguments). find and grep's common options only, which busybox has
	// too.
	argv := []string{"find", in.Path, "-type", "f"}
	if in.Name != "" {
		argv = append(argv, "-name", in.Name)
	}
	var env []string
	if in.Content != "" {
		argv = append(argv, "-exec", "sh", "-c", `grep -nHE -e "$CARREL_PATTERN" -- "$@"`, "sh", "{}", "+")
		env = []string{"CARREL_PATTERN=" + in.Content}
	} else {
		argv = append(argv, "-print0")
	}
	out := &capped{max: MaxOutput}
	errs := &capped{max: 4096}
	rctx, cancel := context.WithTimeout(ctx, DefaultTimeout)
	defer cancel()
	st, err := t.c.Run(rctx, client.Session{VM: vm, Start: &agentv1.ExecRequest{Argv: argv, Env: env}, Stdout: out, Stderr: errs, Stdin: strings.NewReader("")})
	if err != nil {
		if rctx.Err() != nil && ctx.Err() == nil {
			return nil, SearchOut{}, fmt.Errorf("the search did not finish in %s", DefaultTimeout)
		}
		return nil, SearchOut{}, explain(err)
	}
	// grep exits 1 when nothing matched, and find with it; both name on
	// stderr what they could not read.
	if st.Code != 0 && out.b.Len() == 0 && strings.TrimSpace(errs.String()) != "" {
		return nil, SearchOut{}, fmt.Errorf("%s failed (exit %d): %s", argv[0], st.Code, strings.TrimSpace(errs.String()))
	}
	return nil, parseMatches(out.String(), in.Content != "", out.cut), nil
}

// parseMatches reads what the guest's find printed (NUL-separated names)
// or grep (PATH:LINE:TEXT lines), at most maxMatches of them. The output
// is the guest's: a line that does not read as a match ("Binary file ...
// matches", a name with a colon) is left out. A name with ":N:" in it
// reads wrongly; names are the guest's too.
func parseMatches(out string, content, cut bool) SearchOut {
	res := SearchOut{Matches: []Match{}, Truncated: cut}
	if !content {
		for _, p := range strings.Split(out, "\x00") {
			if p == "" {
				continue
			}
			if len(res.Matches) == maxMatches {
				res.Truncated = true
				break
			}
			res.Matches = append(res.Matches, Match{Path: p})
		}
		return res
	}
	for _, line := range strings.Split(out, "\n") {
		p, rest, ok1 := strings.Cut(line, ":")
		num, text, ok2 := strings.Cut(rest, ":")
		n, err := strconv.Atoi(num)
		if !ok1 || !ok2 || err != nil || n <= 0 || p == "" {
			continue
		}
		if len(res.Matches) == maxMatches {
			res.Truncated = true
			break
		}
		res.Matches = append(res.Matches, Match{Path: p, Line: n, Text: text})
	}
	return res
}

// SnapshotIn is snapshot's input.
type SnapshotIn struct {
	VMArg
	Name string `json:"name" jsonschema:"the snapshot's name"`
	Note string `json:"note,omitempty"`
}

// SnapshotOut describes a snapshot.
type SnapshotOut struct {
	Name       string `json:"name"`
	VM         string `json:"vm"`
	CreatedAt  string `json:"created_at"`
	Session    string `json:"session" jsonschema:"the session it was taken in"`
	StateBytes uint64 `json:"state_bytes"`
	Bytes      uint64 `json:"bytes" jsonschema:"the state and the disk layers it froze"`
}

func (t *tools) snapshot(ctx context.Context, _ *mcp.CallToolRequest, in SnapshotIn) (*mcp.CallToolResult, SnapshotOut, error) {
	vm, err := t.target(in.VMArg)
	if err != nil {
		return nil, SnapshotOut{}, err
	}
	resp, err := t.c.VMs.SnapshotVM(ctx, connect.NewRequest(&apiv1.SnapshotVMRequest{Name: vm, Snapshot: in.Name, Note: in.Note}))
	if err != nil {
		return nil, SnapshotOut{}, explain(err)
	}
	s := resp.Msg.Snapshot
	return nil, SnapshotOut{Name: s.Name, VM: s.Vm, CreatedAt: s.CreatedAt, Session: s.Session, StateBytes: s.StateBytes, Bytes: s.Bytes}, nil
}

// RestoreIn is restore's input.
type RestoreIn struct {
	VMArg
	Snapshot string `json:"snapshot" jsonschema:"the snapshot to go back to"`
}

// VMOut is a VM a call made or changed.
type VMOut struct {
	Name    string `json:"name"`
	State   string `json:"state"`
	Session string `json:"session" jsonschema:"its new session"`
}

func vmOut(v *apiv1.VM) VMOut {
	return VMOut{Name: v.Name, State: lower(v.State.String(), "VM_STATE_"), Session: v.Session}
}

func (t *tools) restore(ctx context.Context, _ *mcp.CallToolRequest, in RestoreIn) (*mcp.CallToolResult, VMOut, error) {
	vm, err := t.target(in.VMArg)
	if err != nil {
		return nil, VMOut{}, err
	}
	resp, err := t.c.VMs.RestoreVM(ctx, connect.NewRequest(&apiv1.RestoreVMRequest{Name: vm, Snapshot: in.Snapshot}))
	if err != nil {
		return nil, VMOut{}, explain(err)
	}
	return nil, vmOut(resp.Msg.Vm), nil
}

// ForkIn is fork's input.
type ForkIn struct {
	VMArg
	NewName  string `json:"new_name" jsonschema:"the new VM's name"`
	Snapshot string `json:"snapshot,omitempty" jsonschema:"the snapshot to fork from; one is taken now when none is named"`
}

func (t *tools) fork(ctx context.Context, _ *mcp.CallToolRequest, in ForkIn) (*mcp.CallToolResult, VMOut, error) {
	vm, err := t.target(in.VMArg)
	if err != nil {
		return nil, VMOut{}, err
	}
	resp, err := t.c.VMs.ForkVM(ctx, connect.NewRequest(&apiv1.ForkVMRequest{Name: vm, NewName: in.NewName, Snapshot: in.Snapshot}))
	if err != nil {
		return nil, VMOut{}, explain(err)
	}
	return nil, vmOut(resp.Msg.Vm), nil
}

// CreateIn is vm_create's input.
type CreateIn struct {
	Name        string `json:"name"`
	Image       string `json:"image,omitempty" jsonschema:"an image tag or digest; dev when empty"`
	MemoryBytes uint64 `json:"memory_bytes,omitempty"`
	CPUs        uint32 `json:"cpus,omitempty"`
	Policy      string `json:"policy,omitempty" jsonschema:"the policy the VM runs under; default when empty"`
}

func (t *tools) vmCreate(ctx context.Context, _ *mcp.CallToolRequest, in CreateIn) (*mcp.CallToolResult, VMOut, error) {
	image := in.Image
	if image == "" {
		image = "dev" // as carrel vm create
	}
	resp, err := t.c.VMs.CreateVM(ctx, connect.NewRequest(&apiv1.CreateVMRequest{Name: in.Name, Image: image, MemoryBytes: in.MemoryBytes, Cpus: in.CPUs, Policy: in.Policy}))
	if err != nil {
		return nil, VMOut{}, explain(err)
	}
	return nil, vmOut(resp.Msg.Vm), nil
}

// RemoveVMIn is vm_remove's input.
type RemoveVMIn struct {
	Name string `json:"name"`
}

func (t *tools) vmRemove(ctx context.Context, _ *mcp.CallToolRequest, in RemoveVMIn) (*mcp.CallToolResult, Done, error) {
	if _, err := t.c.VMs.DeleteVM(ctx, connect.NewRequest(&apiv1.DeleteVMRequest{Name: in.Name, Force: true})); err != nil {
		return nil, Done{}, explain(err)
	}
	return nil, Done{OK: true}, nil
}
