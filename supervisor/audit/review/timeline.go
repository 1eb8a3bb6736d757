package review

import (
	"fmt"
	"strings"
)

// KindFilter selects records by kind: a comma-separated list of kinds,
// where "exec.*" stands for every kind starting "exec.". The empty filter
// selects every record.
type KindFilter []string

// ParseKinds parses a --kind value (repeatable, comma-separated).
func ParseKinds(vals []string) (KindFilter, error) {
	var f KindFilter
	for _, v := range vals {
		for _, k := range strings.Split(v, ",") {
			k = strings.TrimSpace(k)
			if k == "" {
				continue
			}
			name := strings.TrimSuffix(k, "*")
			if strings.Contains(name, "*") || !validKindPattern(name) {
				return nil, fmt.Errorf("--kind %q: want kinds such as exec.exit or exec.*", k)
			}
			f = append(f, k)
		}
	}
	return f, nil
}

func validKindPattern(k string) bool {
	for _, c := range []byte(k) {
		if !('a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-') {
			return false
		}
	}
	return k != ""
}

// Match reports whether the filter selects kind.
func (f KindFilter) Match(kind string) bool {
	if len(f) == 0 {
		return true
	}
	for _, k := range f {
		if p, ok := strings.CutSuffix(k, "*"); ok {
			if strings.HasPrefix(kind, p) {
				return true
			}
		} else if k == kind {
			return true
		}
	}
	return false
}

// TimelineLine is one record as `carrel audit show` prints it: time, seq,
// kind, provenance (and session, when asked), then its summary. It is
// safe to print on a terminal.
func TimelineLine(e *Entry, withSession bool) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %7d  %-16s %-5s ", e.Time.UTC().Format(timeLayout), e.Seq, clean(e.Kind, maxKindWidth), clean(string(e.Provenance), 8))
	if withSession {
		s := e.Session
		if s == "" {
			s = "-"
		}
		fmt.Fprintf(&b, "%-20s ", clean(s, 40))
	}
	b.WriteString(Summary(e))
	return strings.TrimRight(b.String(), " ")
}

const maxKindWidth = 64

// TimelineHeader is the header line above TimelineLine's.
func TimelineHeader(withSession bool) string {
	h := fmt.Sprintf("%-24s %7s  %-16s %-5s ", "TIME (UTC)", "SEQ", "KIND", "PROV")
	if withSession {
		h += fmt.Sprintf("%-20s ", "SESSION")
	}
	return h + "SUMMARY"
}
