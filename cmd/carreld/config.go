package main

// carreld's --config file is a JSON object whose keys are carreld's flag
// names, so that a config file and a command line say the same things the
// same way:
//
//	{"driver": "libvirt", "libvirt-uri": "qemu:///system", "boot-timeout": "2m"}
//
// A flag given on the command line wins over the file.

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"sort"
)

// maxConfigBytes bounds a config file.
const maxConfigBytes = 1 << 20

// applyConfig sets, from the JSON object in the file at path, each flag of fs
// that the command line (already parsed into fs) did not set. Values are
// JSON strings, numbers or booleans, parsed as the flag parses its
// command-line value. A key that is not a flag of fs, or is one of
// notInFile (such as the flag that names the file), is an error, found
// before any flag is set; so is a value a flag refuses, after the flags
// before it (in key order) are set. A caller stops on any error.
func applyConfig(fs *flag.FlagSet, path string, notInFile ...string) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("config file: %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxConfigBytes+1))
	if err != nil {
		return fmt.Errorf("config file %s: %w", path, err)
	}
	if len(b) > maxConfigBytes {
		return fmt.Errorf("config file %s: larger than %d bytes", path, maxConfigBytes)
	}
	values, err := parseConfig(b)
	if err != nil {
		return fmt.Errorf("config file %s: %w", path, err)
	}
	onCommandLine := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { onCommandLine[f.Name] = true })

	keys := make([]string, 0, len(values))
	for k := range values {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	// Every key is checked before any flag is set.
	for _, k := range keys {
		fl := fs.Lookup(k)
		switch {
		case fl == nil:
			return fmt.Errorf("config file %s: unknown setting %q (settings are the flag names without their leading dashes)", path, k)
		case slices.Contains(notInFile, k):
			return fmt.Errorf("config file %s: %q can only be given on the command line", path, k)
		}
	}
	for _, k := range keys {
		if onCommandLine[k] {
			continue
		}
		if err := fs.Set(k, values[k]); err != nil {
			return fmt.Errorf("config file %s: %s: %w", path, k, err)
		}
	}
	return nil
}

// parseConfig reads one JSON object of scalars, each value as the text a command
// line would give.
func parseConfig(b []byte) (map[string]string, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var raw map[string]any
	if err := dec.Decode(&raw); err != nil {
		return nil, fmt.Errorf("not a JSON object: %w", err)
	}
	if raw == nil {
		return nil, errors.New("not a JSON object: null")
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("more than one JSON value")
	}
	out := make(map[string]string, len(raw))
	for k, v := range raw {
		switch v := v.(type) {
		case string:
			out[k] = v
		case json.Number:
			out[k] = v.String()
		case bool:
			out[k] = fmt.Sprint(v)
		default:
			return nil, fmt.Errorf("%s: want a string, number or boolean, not %s", k, jsonKind(v))
		}
	}
	return out, nil
}

func jsonKind(v any) string {
	switch v.(type) {
	case nil:
		return "null"
	case []any:
		return "an array"
	default:
		return "an object"
	}
}
