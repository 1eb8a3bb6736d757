//go:build linux

// Package procs lists the guest's userspace processes from /proc.
package procs

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

const (
	// MaxProcesses caps how many processes List returns.
	MaxProcesses = 4096
	// MaxCommandBytes caps one process's command line.
	MaxCommandBytes = 1024
	// MaxCommandsBytes caps all the command lines of one listing, so that
	// it fits one message (protocol.MaxMessageBytes) with room to spare:
	// when they would be longer, each is cut to an equal share.
	MaxCommandsBytes = 640 << 10

	// pfKthread marks a kernel thread in /proc/PID/stat's flags.
	pfKthread = 0x00200000
)

// Process is one entry of /proc.
type Process struct {
	Pid, PPid int
	// Pgid and Sid are the process group and session.
	Pgid, Sid int
	// UID is the effective uid.
	UID uint32
	// State is one letter: R, S, D, Z, T, ...
	State string
	// Command is the command line, arguments joined by spaces, valid
	// UTF-8; "[comm]" when the command line is empty (a zombie).
	Command string
	// RSSBytes is resident memory.
	RSSBytes uint64
}

// List returns the userspace processes (not kernel threads) in root (a
// procfs mount, normally /proc) ordered by pid, at most MaxProcesses of
// them. Processes that exit while being read are left out.
func List(root string) ([]Process, error) {
	d, err := os.Open(root)
	if err != nil {
		return nil, fmt.Errorf("list processes: %w", err)
	}
	defer d.Close()
	var pids []int
	for {
		names, err := d.Readdirnames(256)
		for _, n := range names {
			if pid, err := strconv.Atoi(n); err == nil && pid > 0 {
				pids = append(pids, pid)
			}
		}
		if errors.Is(err, io.EOF) || len(pids) > 4*MaxProcesses {
			break // kernel threads are skipped later; leave room for them
		}
		if err != nil {
			return nil, fmt.Errorf("list processes: %w", err)
		}
	}
	slices.Sort(pids)
	page := uint64(os.Getpagesize())
	out := make([]Process, 0, min(len(pids), MaxProcesses))
	total := 0
	for _, pid := range pids {
		if len(out) == MaxProcesses {
			break
		}
		p, ok := read(filepath.Join(root, strconv.Itoa(pid)), page)
		if ok {
			p.Pid = pid
			out = append(out, p)
			total += len(p.Command)
		}
	}
	if total > MaxCommandsBytes {
		share := MaxCommandsBytes / len(out)
		for i := range out {
			out[i].Command = cut(out[i].Command, share)
		}
	}
	return out, nil
}

// read reads one process; ok is false for a kernel thread or a process
// that is gone.
func read(dir string, page uint64) (p Process, ok bool) {
	stat, err := readFile(filepath.Join(dir, "stat"), 4096)
	if err != nil {
		return p, false
	}
	comm, fields, ok := parseStat(stat)
	if !ok {
		return p, false
	}
	// fields[0] is field 3 of stat(5): state, ppid, pgrp, session, tty_nr,
	// tpgid, flags.
	flags, err := strconv.ParseUint(fields[6], 10, 64)
	if err != nil || flags&pfKthread != 0 {
		return p, false
	}
	p.State = fields[0]
	p.PPid, _ = strconv.Atoi(fields[1])
	p.Pgid, _ = strconv.Atoi(fields[2])
	p.Sid, _ = strconv.Atoi(fields[3])

	cmdline, err := readFile(filepath.Join(dir, "cmdline"), MaxCommandBytes+1)
	if err != nil {
		return p, false
	}
	cmdline = bytes.TrimRight(cmdline, "\x00")
	if len(cmdline) == 0 {
		p.Command = "[" + comm + "]"
	} else {
		p.Command = cut(strings.ReplaceAll(string(cmdline), "\x00", " "), MaxCommandBytes)
	}
	if uid, ok := statusUID(filepath.Join(dir, "status")); ok {
		p.UID = uid
	}
	if statm, err := readFile(filepath.Join(dir, "statm"), 256); err == nil {
		if f := strings.Fields(string(statm)); len(f) > 1 {
			rss, _ := strconv.ParseUint(f[1], 10, 64)
			p.RSSBytes = rss * page
		}
	}
	return p, true
}

// parseStat splits /proc/PID/stat: the comm between the first '(' and the
// last ')', which may itself hold spaces and parentheses, and the fields
// after it.
func parseStat(stat []byte) (comm string, fields []string, ok bool) {
	open := bytes.IndexByte(stat, '(')
	closing := bytes.LastIndexByte(stat, ')')
	if open < 0 || closing < open {
		return "", nil, false
	}
	fields = strings.Fields(string(stat[closing+1:]))
	if len(fields) < 7 {
		return "", nil, false
	}
	return strings.ToValidUTF8(string(stat[open+1:closing]), "\uFFFD"), fields, true
}

// statusUID returns the effective uid from /proc/PID/status.
func statusUID(path string) (uint32, bool) {
	b, err := readFile(path, 16<<10)
	if err != nil {
		return 0, false
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		rest, found := strings.CutPrefix(sc.Text(), "Uid:")
		if !found {
			continue
		}
		f := strings.Fields(rest) // real, effective, saved, file system
		if len(f) < 2 {
			return 0, false
		}
		uid, err := strconv.ParseUint(f[1], 10, 32)
		return uint32(uid), err == nil
	}
	return 0, false
}

func readFile(path string, max int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(io.LimitReader(f, max))
}

// cut returns s as valid UTF-8 of at most n bytes, marking a cut with "...".
func cut(s string, n int) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	if len(s) <= n {
		return s
	}
	n = max(n-3, 0)
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "..."
}
