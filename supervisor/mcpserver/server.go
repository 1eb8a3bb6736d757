// Package mcpserver serves carrel to agents over the Model Context
// Protocol: each tool is an ordinary call to carreld through the Go client
// (supervisor/client), made as the MCP server's caller (the local user by
// peer credentials, or a token's holder), so that the VM's policy decides
// it, the guest enforces it, and the audit log records it with that
// caller. The server holds no state of its own.
//
// A server is scoped to one VM (Config.VM): its tools act on that VM and
// take no VM argument, and it lists that VM's resources (its audit
// timeline and console). Without a scope, each tool names its VM and the
// resources are templates. Over HTTP, each session is scoped to its
// token's VM.
package mcpserver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"path"
	"time"
	"unicode/utf8"

	"connectrpc.com/connect"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

// Bounds on what one tool call returns, so that a command or a file can
// not flood the agent's context.
const (
	// MaxOutput caps each of a command's stdout and stderr.
	MaxOutput = 1 << 20
	// MaxRead caps what read_file returns.
	MaxRead = 4 << 20
	// MaxWrite caps what write_file takes.
	MaxWrite = 16 << 20
	// DefaultTimeout and MaxTimeout bound exec.
	DefaultTimeout = 2 * time.Minute
	MaxTimeout     = 30 * time.Minute
	// maxEntries caps list_dir.
	maxEntries = 10000
)

// Config says what the server serves.
type Config struct {
	// VM scopes every tool to one VM; "" lets each call name its VM.
	VM string
	// Version is reported to the client.
	Version string
}

// New returns an MCP server whose tools call carreld through c.
func New(c *client.Client, cfg Config) *mcp.Server {
	t := &tools{c: c, vm: cfg.VM}
	s := mcp.NewServer(&mcp.Implementation{Name: "carrel", Title: "carrel: a computer of its own for an agent", Version: cfg.Version}, &mcp.ServerOptions{
		Instructions: instructions(cfg.VM),
		// When the session ends, so do its port forwards and its
		// connections to carreld.
		InitializedHandler: func(_ context.Context, req *mcp.InitializedRequest) {
			go func() {
				_ = req.Session.Wait()
				t.fwd.stopAll()
				c.CloseIdleConnections()
			}()
		},
	})
	mcp.AddTool(s, &mcp.Tool{Name: "exec", Description: "Run a command in the VM and wait for it: argv, or a shell command line run by /bin/sh -c. " +
		"Returns its exit code and its stdout and stderr (each cut at 1 MiB, saying so)."}, t.exec)
	mcp.AddTool(s, &mcp.Tool{Name: "read_file", Description: "Read a file of the VM (at most 4 MiB; text, or base64 when it is not UTF-8)."}, t.readFile)
	mcp.AddTool(s, &mcp.Tool{Name: "write_file", Description: "Write a file in the VM, whole and atomically, making its directories if asked."}, t.writeFile)
	mcp.AddTool(s, &mcp.Tool{Name: "list_dir", Description: "List a directory of the VM, recursively if asked."}, t.listDir)
	mcp.AddTool(s, &mcp.Tool{Name: "stat", Description: "Describe a file of the VM: type, size, mode, owner, modification time."}, t.stat)
	mcp.AddTool(s, &mcp.Tool{Name: "make_dir", Description: "Make a directory in the VM."}, t.makeDir)
	mcp.AddTool(s, &mcp.Tool{Name: "remove", Description: "Remove a file, or a directory (recursive to remove what it holds)."}, t.remove)
	mcp.AddTool(s, &mcp.Tool{Name: "move", Description: "Move or rename a file or directory within the VM."}, t.move)
	mcp.AddTool(s, &mcp.Tool{Name: "vm_list", Description: "List the VMs the caller may see, with their state."}, t.vmList)
	addMore(s, t)
	addResources(s, t)
	return s
}

func instructions(vm string) string {
	if vm != "" {
		return fmt.Sprintf("These tools act on the carrel VM %q: a Linux computer of its own. Every call is decided by the VM's policy and recorded in its audit log; a denied call says which rule denied it. "+
			"The resources %s and %s hold the VM's recent audit timeline and the end of its serial console.", vm, ResourceURI(vm, auditResource), ResourceURI(vm, consoleResource))
	}
	return "These tools act on carrel VMs (Linux computers of their own); each call names its VM (vm_list shows them). Every call is decided by the VM's policy and recorded in its audit log; a denied call says which rule denied it. " +
		"The resources carrel://vm/NAME/audit and carrel://vm/NAME/console hold a VM's recent audit timeline and the end of its serial console."
}

type tools struct {
	c   *client.Client
	vm  string
	fwd forwards
}

// VMArg names the VM of a call when the server has no scope.
type VMArg struct {
	VM string `json:"vm,omitempty" jsonschema:"the VM to act on; not needed (and refused if it differs) when the server is scoped to one VM"`
}

// target is the VM a call acts on.
func (t *tools) target(a VMArg) (string, error) {
	switch {
	case t.vm == "":
		if a.VM == "" {
			return "", errors.New("name the vm (vm_list shows them)")
		}
		return a.VM, nil
	case a.VM != "" && a.VM != t.vm:
		return "", fmt.Errorf("this server acts on vm %q only", t.vm)
	}
	return t.vm, nil
}

// ExecIn is exec's input.
type ExecIn struct {
	VMArg
	Argv           []string          `json:"argv,omitempty" jsonschema:"the command and its arguments; give this or command"`
	Command        string            `json:"command,omitempty" jsonschema:"a shell command line, run by /bin/sh -c; give this or argv"`
	Cwd            string            `json:"cwd,omitempty" jsonschema:"the working directory; the user's home by default"`
	Env            map[string]string `json:"env,omitempty" jsonschema:"environment variables to add"`
	Stdin          string            `json:"stdin,omitempty" jsonschema:"text for the command's standard input"`
	TimeoutSeconds int               `json:"timeout_seconds,omitempty" jsonschema:"how long to wait before the command is killed; 120 by default, at most 1800"`
}

// ExecOut is exec's output.
type ExecOut struct {
	ExitCode int `json:"exit_code" jsonschema:"the exit code, or 128 and the signal's number when a signal ended the command"`
	// Signal is the signal that ended the command, if one did.
	Signal          string `json:"signal,omitempty" jsonschema:"the signal that ended the command (e.g. SIGKILL), if one did"`
	Stdout          string `json:"stdout"`
	Stderr          string `json:"stderr"`
	StdoutTruncated bool   `json:"stdout_truncated,omitempty" jsonschema:"stdout was longer than 1 MiB and was cut"`
	StderrTruncated bool   `json:"stderr_truncated,omitempty" jsonschema:"stderr was longer than 1 MiB and was cut"`
}

func (t *tools) exec(ctx context.Context, _ *mcp.CallToolRequest, in ExecIn) (*mcp.CallToolResult, ExecOut, error) {
	vm, err := t.target(in.VMArg)
	if err != nil {
		return nil, ExecOut{}, err
	}
	argv := in.Argv
	switch {
	case len(argv) > 0 && in.Command != "":
		return nil, ExecOut{}, errors.New("give argv or command, not both")
	case in.Command != "":
		argv = []string{"/bin/sh", "-c", in.Command}
	case len(argv) == 0:
		return nil, ExecOut{}, errors.New("give argv or command")
	}
	timeout := DefaultTimeout
	if in.TimeoutSeconds > 0 {
		timeout = min(time.Duration(in.TimeoutSeconds)*time.Second, MaxTimeout)
	}
	env := make([]string, 0, len(in.Env))
	for k, v := range in.Env {
		env = append(env, k+"="+v)
	}
	stdout, stderr := &capped{max: MaxOutput}, &capped{max: MaxOutput}
	s := client.Session{VM: vm, Start: &agentv1.ExecRequest{Argv: argv, Env: env, Cwd: in.Cwd}, Stdout: stdout, Stderr: stderr}
	if in.Stdin != "" {
		s.Stdin = bytes.NewReader([]byte(in.Stdin))
	} else {
		s.Stdin = bytes.NewReader(nil) // EOF at once
	}
	rctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	st, err := t.c.Run(rctx, s)
	if err != nil {
		if rctx.Err() != nil && ctx.Err() == nil {
			return nil, ExecOut{}, fmt.Errorf("the command did not finish in %s and was killed", timeout)
		}
		return nil, ExecOut{}, explain(err)
	}
	return nil, ExecOut{ExitCode: int(st.Code), Signal: st.Signal, Stdout: stdout.String(), Stderr: stderr.String(), StdoutTruncated: stdout.cut, StderrTruncated: stderr.cut}, nil
}

// ReadIn is read_file's input.
type ReadIn struct {
	VMArg
	Path     string `json:"path" jsonschema:"the file, an absolute path in the VM"`
	MaxBytes int64  `json:"max_bytes,omitempty" jsonschema:"read at most this much; 4 MiB by default and at most"`
}

// ReadOut is read_file's output.
type ReadOut struct {
	Content   string `json:"content"`
	Encoding  string `json:"encoding" jsonschema:"utf-8, or base64 for a file that is not text"`
	Size      int64  `json:"size" jsonschema:"the file's size"`
	Truncated bool   `json:"truncated,omitempty" jsonschema:"the file is larger than what was read"`
}

func (t *tools) readFile(ctx context.Context, _ *mcp.CallToolRequest, in ReadIn) (*mcp.CallToolResult, ReadOut, error) {
	vm, err := t.target(in.VMArg)
	if err != nil {
		return nil, ReadOut{}, err
	}
	limit := int64(MaxRead)
	if in.MaxBytes > 0 {
		limit = min(limit, in.MaxBytes)
	}
	info, err := t.c.Stat(ctx, vm, in.Path)
	if err != nil {
		return nil, ReadOut{}, explain(err)
	}
	if info.Type != agentv1.FileType_FILE_TYPE_REGULAR {
		return nil, ReadOut{}, fmt.Errorf("%s is a %s, not a file", in.Path, kind(info.Type))
	}
	stream, err := t.c.Files.Read(ctx, client.ForVM(vm, &agentv1.ReadRequest{Path: in.Path, Length: limit}))
	if err != nil {
		return nil, ReadOut{}, explain(err)
	}
	defer stream.Close()
	buf := &capped{max: int(limit)}
	for stream.Receive() {
		buf.Write(stream.Msg().Data)
	}
	if err := stream.Err(); err != nil {
		return nil, ReadOut{}, explain(err)
	}
	out := ReadOut{Size: info.Size, Truncated: info.Size > int64(buf.b.Len()), Encoding: "utf-8", Content: buf.String()}
	if out.Truncated {
		// A cut through a character is not binary.
		out.Content = trimRune(buf.b.Bytes())
	}
	if !utf8.ValidString(out.Content) {
		out.Encoding, out.Content = "base64", base64Of(buf.b.Bytes())
	}
	return nil, out, nil
}

// WriteIn is write_file's input.
type WriteIn struct {
	VMArg
	Path        string `json:"path" jsonschema:"the file, an absolute path in the VM"`
	Content     string `json:"content"`
	Encoding    string `json:"encoding,omitempty" jsonschema:"utf-8 (the default), or base64"`
	Mode        uint32 `json:"mode,omitempty" jsonschema:"the file's mode, e.g. 420 (0644), the default"`
	MakeParents bool   `json:"make_parents,omitempty" jsonschema:"make the directories above the file"`
}

// WriteOut is write_file's output.
type WriteOut struct {
	Bytes  int64  `json:"bytes"`
	SHA256 string `json:"sha256"`
}

func (t *tools) writeFile(ctx context.Context, _ *mcp.CallToolRequest, in WriteIn) (*mcp.CallToolResult, WriteOut, error) {
	vm, err := t.target(in.VMArg)
	if err != nil {
		return nil, WriteOut{}, err
	}
	data := []byte(in.Content)
	switch in.Encoding {
	case "", "utf-8":
	case "base64":
		if data, err = unbase64(in.Content); err != nil {
			return nil, WriteOut{}, fmt.Errorf("content: %w", err)
		}
	default:
		return nil, WriteOut{}, fmt.Errorf("encoding %q: want utf-8 or base64", in.Encoding)
	}
	if len(data) > MaxWrite {
		return nil, WriteOut{}, fmt.Errorf("%d bytes, over the %d write_file takes: copy large files with carrel cp", len(data), MaxWrite)
	}
	mode := in.Mode
	if mode == 0 {
		mode = 0o644
	}
	if in.MakeParents {
		if _, err := t.c.Files.MakeDir(ctx, client.ForVM(vm, &agentv1.MakeDirRequest{Path: path.Dir(in.Path), Parents: true, Mode: 0o755})); err != nil {
			return nil, WriteOut{}, explain(err)
		}
	}
	resp, err := t.c.Upload(ctx, vm, in.Path, bytes.NewReader(data), mode)
	if err != nil {
		return nil, WriteOut{}, explain(err)
	}
	return nil, WriteOut{Bytes: resp.Size, SHA256: resp.Digest}, nil
}

// PathIn is the input of the tools that take one path.
type PathIn struct {
	VMArg
	Path string `json:"path" jsonschema:"an absolute path in the VM"`
}

// Entry describes a file.
type Entry struct {
	Path       string `json:"path"`
	Type       string `json:"type" jsonschema:"file, directory, symlink or other"`
	Size       int64  `json:"size"`
	Mode       string `json:"mode" jsonschema:"permission bits, octal"`
	UID        uint32 `json:"uid"`
	GID        uint32 `json:"gid"`
	Modified   string `json:"modified" jsonschema:"RFC 3339"`
	LinkTarget string `json:"link_target,omitempty"`
}

func entryOf(f *agentv1.FileInfo) Entry {
	return Entry{
		Path: f.Path, Type: kind(f.Type), Size: f.Size, Mode: fmt.Sprintf("%04o", f.Mode&0o7777), UID: f.Uid, GID: f.Gid,
		Modified: time.Unix(0, f.MtimeUnixNano).UTC().Format(time.RFC3339Nano), LinkTarget: f.LinkTarget,
	}
}

func kind(t agentv1.FileType) string {
	switch t {
	case agentv1.FileType_FILE_TYPE_REGULAR:
		return "file"
	case agentv1.FileType_FILE_TYPE_DIRECTORY:
		return "directory"
	case agentv1.FileType_FILE_TYPE_SYMLINK:
		return "symlink"
	}
	return "other"
}

func (t *tools) stat(ctx context.Context, _ *mcp.CallToolRequest, in PathIn) (*mcp.CallToolResult, Entry, error) {
	vm, err := t.target(in.VMArg)
	if err != nil {
		return nil, Entry{}, err
	}
	info, err := t.c.Stat(ctx, vm, in.Path)
	if err != nil {
		return nil, Entry{}, explain(err)
	}
	return nil, entryOf(info), nil
}

// ListIn is list_dir's input.
type ListIn struct {
	VMArg
	Path      string `json:"path" jsonschema:"the directory, an absolute path in the VM"`
	Recursive bool   `json:"recursive,omitempty"`
	MaxDepth  uint32 `json:"max_depth,omitempty" jsonschema:"with recursive, how deep; 0 for no bound"`
}

// ListOut is list_dir's output.
type ListOut struct {
	Entries   []Entry `json:"entries"`
	Truncated bool    `json:"truncated,omitempty" jsonschema:"there were more than 10000 entries"`
}

func (t *tools) listDir(ctx context.Context, _ *mcp.CallToolRequest, in ListIn) (*mcp.CallToolResult, ListOut, error) {
	vm, err := t.target(in.VMArg)
	if err != nil {
		return nil, ListOut{}, err
	}
	stream, err := t.c.Files.List(ctx, client.ForVM(vm, &agentv1.ListRequest{Path: in.Path, Recursive: in.Recursive, MaxDepth: in.MaxDepth, MaxEntries: maxEntries}))
	if err != nil {
		return nil, ListOut{}, explain(err)
	}
	defer stream.Close()
	out := ListOut{Entries: []Entry{}}
	for stream.Receive() {
		for _, e := range stream.Msg().Entries {
			out.Entries = append(out.Entries, entryOf(e))
		}
		out.Truncated = out.Truncated || stream.Msg().Truncated
	}
	if err := stream.Err(); err != nil {
		return nil, ListOut{}, explain(err)
	}
	return nil, out, nil
}

// MakeDirIn is make_dir's input.
type MakeDirIn struct {
	VMArg
	Path    string `json:"path" jsonschema:"the directory, an absolute path in the VM"`
	Parents bool   `json:"parents,omitempty" jsonschema:"make the directories above it too, and do not fail if it exists"`
}

// Done is the output of tools that return nothing else.
type Done struct {
	OK bool `json:"ok"`
}

func (t *tools) makeDir(ctx context.Context, _ *mcp.CallToolRequest, in MakeDirIn) (*mcp.CallToolResult, Done, error) {
	vm, err := t.target(in.VMArg)
	if err != nil {
		return nil, Done{}, err
	}
	if _, err := t.c.Files.MakeDir(ctx, client.ForVM(vm, &agentv1.MakeDirRequest{Path: in.Path, Parents: in.Parents, Mode: 0o755})); err != nil {
		return nil, Done{}, explain(err)
	}
	return nil, Done{OK: true}, nil
}

// RemoveIn is remove's input.
type RemoveIn struct {
	VMArg
	Path      string `json:"path" jsonschema:"an absolute path in the VM"`
	Recursive bool   `json:"recursive,omitempty" jsonschema:"remove a directory and all it holds"`
}

func (t *tools) remove(ctx context.Context, _ *mcp.CallToolRequest, in RemoveIn) (*mcp.CallToolResult, Done, error) {
	vm, err := t.target(in.VMArg)
	if err != nil {
		return nil, Done{}, err
	}
	if _, err := t.c.Files.Remove(ctx, client.ForVM(vm, &agentv1.RemoveRequest{Path: in.Path, Recursive: in.Recursive})); err != nil {
		return nil, Done{}, explain(err)
	}
	return nil, Done{OK: true}, nil
}

// MoveIn is move's input.
type MoveIn struct {
	VMArg
	From string `json:"from" jsonschema:"an absolute path in the VM"`
	To   string `json:"to" jsonschema:"an absolute path in the VM"`
}

func (t *tools) move(ctx context.Context, _ *mcp.CallToolRequest, in MoveIn) (*mcp.CallToolResult, Done, error) {
	vm, err := t.target(in.VMArg)
	if err != nil {
		return nil, Done{}, err
	}
	if _, err := t.c.Files.Rename(ctx, client.ForVM(vm, &agentv1.RenameRequest{From: in.From, To: in.To})); err != nil {
		return nil, Done{}, explain(err)
	}
	return nil, Done{OK: true}, nil
}

// VMListIn is vm_list's input.
type VMListIn struct{}

// VMInfo describes a VM.
type VMInfo struct {
	Name   string `json:"name"`
	State  string `json:"state" jsonschema:"running, stopped, starting, ..."`
	Agent  string `json:"agent" jsonschema:"ready, unhealthy, ..."`
	Paused bool   `json:"paused,omitempty"`
	Image  string `json:"image_digest"`
	Policy string `json:"policy,omitempty"`
}

// VMListOut is vm_list's output.
type VMListOut struct {
	VMs []VMInfo `json:"vms"`
}

func (t *tools) vmList(ctx context.Context, _ *mcp.CallToolRequest, _ VMListIn) (*mcp.CallToolResult, VMListOut, error) {
	var vms []*apiv1.VM
	if t.vm != "" {
		// Its own VM only: a token may read that, not the list.
		resp, err := t.c.VMs.GetVM(ctx, connect.NewRequest(&apiv1.GetVMRequest{Name: t.vm}))
		if err != nil {
			return nil, VMListOut{}, explain(err)
		}
		vms = []*apiv1.VM{resp.Msg.Vm}
	} else {
		resp, err := t.c.VMs.ListVMs(ctx, connect.NewRequest(&apiv1.ListVMsRequest{}))
		if err != nil {
			return nil, VMListOut{}, explain(err)
		}
		vms = resp.Msg.Vms
	}
	out := VMListOut{VMs: []VMInfo{}}
	for _, v := range vms {
		out.VMs = append(out.VMs, VMInfo{
			Name: v.Name, State: lower(v.State.String(), "VM_STATE_"), Agent: lower(v.AgentState.String(), "AGENT_STATE_"),
			Paused: v.Paused, Image: v.ImageDigest, Policy: v.Policy,
		})
	}
	return nil, out, nil
}

// capped keeps the first max bytes written to it and notes what it cut.
type capped struct {
	b   bytes.Buffer
	max int
	cut bool
}

func (c *capped) Write(p []byte) (int, error) {
	if room := c.max - c.b.Len(); len(p) > room {
		c.b.Write(p[:max(room, 0)])
		c.cut = true
		return len(p), nil
	}
	return c.b.Write(p)
}

// String is what was kept, with any UTF-8 sequence the cut split dropped.
func (c *capped) String() string {
	if c.cut {
		return trimRune(c.b.Bytes())
	}
	return c.b.String()
}

// trimRune is b without the start of a UTF-8 sequence that a cut left at
// its end.
func trimRune(b []byte) string {
	n := len(b)
	for i := 1; i < utf8.UTFMax && n-i >= 0; i++ {
		if utf8.RuneStart(b[n-i]) {
			if r, _ := utf8.DecodeRune(b[n-i:]); r == utf8.RuneError && !utf8.FullRune(b[n-i:]) {
				return string(b[:n-i])
			}
			break
		}
	}
	return string(b)
}

var _ io.Writer = (*capped)(nil)
