package policy

import (
	"errors"

	"github.com/carrel-os/carrel/policy/bundle"
)

// Bundles live in policy/bundle, which does not import OPA: a program that
// only reads or sends them (the carrel CLI) does not link the engine.
// These names keep them part of this package's API.

// A Bundle is a policy's source (see bundle.Bundle); Compile makes it a
// policy.
type Bundle = bundle.Bundle

// Caps on a bundle, the name of its data document, and the name of the
// default policy.
const (
	MaxBundleFiles = bundle.MaxFiles
	MaxBundleBytes = bundle.MaxBytes
	DataFile       = bundle.DataFile
	DefaultName    = bundle.DefaultName
)

// Errors callers branch on.
var (
	ErrInvalidBundle = bundle.ErrInvalid
	ErrNoSuchPolicy  = bundle.ErrNoSuchPolicy
	ErrInvalidInput  = errors.New("invalid policy input")
)

// NewBundle is bundle.New.
func NewBundle(files map[string][]byte) (*Bundle, error) { return bundle.New(files) }

// FromFiles is bundle.FromFiles.
func FromFiles(files map[string][]byte) (*Bundle, error) { return bundle.FromFiles(files) }

// LoadDir is bundle.LoadDir.
func LoadDir(dir string) (*Bundle, error) { return bundle.LoadDir(dir) }

// Builtin is bundle.Builtin.
func Builtin(name string) (*Bundle, error) { return bundle.Builtin(name) }

// BuiltinNames is bundle.BuiltinNames.
func BuiltinNames() []string { return bundle.BuiltinNames() }
