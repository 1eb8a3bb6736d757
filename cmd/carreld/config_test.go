package main

import (
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

type testSettings struct {
	driver, uri, level string
	timeout            time.Duration
	debug              bool
	n                  int
}

func testFlags(args ...string) (*flag.FlagSet, *testSettings) {
	fs := flag.NewFlagSet("carreld", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	s := &testSettings{}
	fs.StringVar(&s.driver, "driver", "qemu", "")
	fs.StringVar(&s.uri, "libvirt-uri", "qemu:///system", "")
	fs.StringVar(&s.level, "log-level", "info", "")
	fs.DurationVar(&s.timeout, "boot-timeout", 90*time.Second, "")
	fs.BoolVar(&s.debug, "debug", false, "")
	fs.IntVar(&s.n, "n", 1, "")
	fs.String("config", "", "")
	if err := fs.Parse(args); err != nil {
		panic(err)
	}
	return fs, s
}

func writeConfig(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "carreld.json")
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestFileSetsFlagsAndCommandLineWins(t *testing.T) {
	p := writeConfig(t, `{"driver": "libvirt", "libvirt-uri": "qemu+unix:///system?socket=/x", "boot-timeout": "2m", "debug": true, "n": 3, "log-level": "warn"}`)
	fs, s := testFlags("--log-level", "debug", "--config", p)
	if err := applyConfig(fs, p, "config"); err != nil {
		t.Fatal(err)
	}
	want := testSettings{driver: "libvirt", uri: "qemu+unix:///system?socket=/x", level: "debug", timeout: 2 * time.Minute, debug: true, n: 3}
	if *s != want {
		t.Errorf("settings %+v, want %+v", *s, want)
	}
}

func TestEmptyFileChangesNothing(t *testing.T) {
	fs, s := testFlags()
	if err := applyConfig(fs, writeConfig(t, "{}\n"), "config"); err != nil {
		t.Fatal(err)
	}
	if s.driver != "qemu" || s.timeout != 90*time.Second {
		t.Errorf("defaults changed: %+v", *s)
	}
}

func TestBadFiles(t *testing.T) {
	for _, c := range []struct{ content, want string }{
		{`{"drvier": "libvirt"}`, `unknown setting "drvier"`},
		{`{"--driver": "libvirt"}`, `unknown setting "--driver"`},
		{`{"config": "/etc/other.json"}`, `"config" can only be given on the command line`},
		{`{"boot-timeout": "soon"}`, "boot-timeout"},
		{`{"boot-timeout": 90}`, "boot-timeout"}, // a duration needs its unit
		{`{"n": 1.5}`, "n:"},
		{`{"debug": "maybe"}`, "debug"},
		{`{"driver": ["libvirt"]}`, "not an array"},
		{`{"driver": null}`, "not null"},
		{`{"driver": {"name": "libvirt"}}`, "not an object"},
		{`["driver", "libvirt"]`, "not a JSON object"},
		{`null`, "not a JSON object"},
		{`{"driver": "libvirt"} {"driver": "qemu"}`, "more than one JSON value"},
		{`driver = "libvirt"`, "not a JSON object"},
		{``, "not a JSON object"},
	} {
		fs, s := testFlags()
		err := applyConfig(fs, writeConfig(t, c.content), "config")
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "carreld.json") {
			t.Errorf("%s: error %v, want one naming the file and %q", c.content, err, c.want)
		}
		if s.driver != "qemu" {
			t.Errorf("%s: a refused file set the driver to %q", c.content, s.driver)
		}
	}
}

func TestUnknownKeyIsFoundBeforeAnythingIsSet(t *testing.T) {
	fs, s := testFlags()
	// "driver" sorts before "zzz": it must not be set either.
	if err := applyConfig(fs, writeConfig(t, `{"driver": "libvirt", "zzz": 1}`), "config"); err == nil {
		t.Fatal("no error")
	}
	if s.driver != "qemu" {
		t.Errorf("driver %q set by a refused file", s.driver)
	}
}

func TestMissingAndHugeFiles(t *testing.T) {
	fs, _ := testFlags()
	if err := applyConfig(fs, filepath.Join(t.TempDir(), "none.json"), "config"); err == nil || !strings.Contains(err.Error(), "none.json") {
		t.Errorf("missing file: %v", err)
	}
	huge := `{"driver": "` + strings.Repeat("x", maxConfigBytes) + `"}`
	if err := applyConfig(fs, writeConfig(t, huge), "config"); err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Errorf("huge file: %v", err)
	}
}
