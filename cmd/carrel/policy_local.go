package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"

	"google.golang.org/protobuf/encoding/protojson"

	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

// The policy engine is not linked into carrel: `policy test`, `policy
// check` and `policy eval` of a local bundle run carrel-policy, which is,
// so that every other command starts without OPA's weight.

// policyEngine finds carrel-policy: beside this carrel, or on PATH.
func policyEngine() (string, error) {
	if self, err := os.Executable(); err == nil {
		p := filepath.Join(filepath.Dir(self), "carrel-policy")
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	p, err := exec.LookPath("carrel-policy")
	if err != nil {
		return "", errors.New("this command needs carrel-policy, the policy engine, beside carrel or on PATH (make build puts it in out/bin)")
	}
	return p, nil
}

// runPolicyEngine runs carrel-policy with args, its output passed through;
// its exit status becomes carrel's.
func runPolicyEngine(stdout, stderr io.Writer, args ...string) error {
	p, err := policyEngine()
	if err != nil {
		return err
	}
	cmd := exec.Command(p, args...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, stdout, stderr
	var ee *exec.ExitError
	if err := cmd.Run(); errors.As(err, &ee) {
		return exitError{code: ee.ExitCode()}
	} else if err != nil {
		return err
	}
	return nil
}

// evalLocal decides input with the local bundle pol, through carrel-policy.
func evalLocal(kind, pol string, input []byte, stderr io.Writer) (*apiv1.Decision, error) {
	p, err := policyEngine()
	if err != nil {
		return nil, err
	}
	var out bytes.Buffer
	cmd := exec.Command(p, "eval", kind, pol)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = bytes.NewReader(input), &out, stderr
	var ee *exec.ExitError
	if err := cmd.Run(); errors.As(err, &ee) {
		return nil, exitError{code: ee.ExitCode()}
	} else if err != nil {
		return nil, err
	}
	var d apiv1.Decision
	if err := protojson.Unmarshal(out.Bytes(), &d); err != nil {
		return nil, fmt.Errorf("carrel-policy eval: %w", err)
	}
	return &d, nil
}
