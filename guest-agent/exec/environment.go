package exec

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"strings"
)

// EnvironmentFile is the image's environment for every command (as
// pam_env reads it for a login): KEY=VALUE or KEY="VALUE" lines.
const EnvironmentFile = "/etc/environment"

// Limits on EnvironmentFile.
const (
	maxEnvironmentBytes   = 64 << 10
	maxEnvironmentEntries = 256
)

// ReadEnvironment reads an environment file: KEY=VALUE lines, the value
// optionally in double quotes, with blank lines, comments and "export "
// prefixes allowed. Malformed lines are skipped and reported together in
// the error, beside the entries that parsed. A missing file is no error.
func ReadEnvironment(path string) ([]string, error) {
	f, err := os.Open(path)
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxEnvironmentBytes+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxEnvironmentBytes {
		return nil, fmt.Errorf("%s is over %d bytes", path, maxEnvironmentBytes)
	}
	var env, bad []string
	sc := bufio.NewScanner(bytes.NewReader(b))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		line = strings.TrimPrefix(line, "export ")
		k, v, ok := strings.Cut(line, "=")
		if !ok || !validEnvName(k) || len(env) >= maxEnvironmentEntries {
			bad = append(bad, fmt.Sprint(n))
			continue
		}
		if len(v) >= 2 && v[0] == '"' && v[len(v)-1] == '"' {
			v = v[1 : len(v)-1]
		}
		env = append(env, k+"="+v)
	}
	if len(bad) > 0 {
		return env, fmt.Errorf("%s: lines %s skipped: want KEY=VALUE", path, strings.Join(bad, ", "))
	}
	return env, nil
}

func validEnvName(k string) bool {
	if k == "" || len(k) > 128 {
		return false
	}
	for i := 0; i < len(k); i++ {
		c := k[i]
		if !(c == '_' || 'A' <= c && c <= 'Z' || 'a' <= c && c <= 'z' || i > 0 && '0' <= c && c <= '9') {
			return false
		}
	}
	return true
}
