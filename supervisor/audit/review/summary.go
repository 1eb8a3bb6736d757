package review

import (
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/carrel-os/carrel/supervisor/audit"
)

// maxField caps one guest- or caller-supplied string in a summary.
const maxField = 200

// clean makes s safe to print on a terminal and readable in a page:
// control characters, bidirectional overrides and bytes that are not
// UTF-8 become Go-style escapes, and it is cut at max runes. Everything
// in a record may come from a hostile guest or caller.
func clean(s string, max int) string {
	var b strings.Builder
	n := 0
	for i := 0; i < len(s); {
		if n == max {
			b.WriteString("…")
			break
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\t':
			b.WriteString(`\t`)
		case unicode.IsControl(r) || unicode.Is(unicode.Bidi_Control, r) || r == '\u2028' || r == '\u2029':
			q := strconv.QuoteRuneToASCII(r)
			b.WriteString(q[1 : len(q)-1])
		default:
			b.WriteRune(r)
		}
		i += size
		n++
	}
	return b.String()
}

// shellWord quotes one argument the way a POSIX shell would read it back,
// with what cannot be printed escaped.
func shellWord(s string) string {
	if s == "" {
		return "''"
	}
	plain := true
	for _, r := range s {
		if !(r < utf8.RuneSelf && (r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("@%+=:,./_-", r))) {
			plain = false
			break
		}
	}
	if plain {
		return s
	}
	if clean(s, -1) != s {
		return "$'" + strings.ReplaceAll(clean(s, -1), `'`, `\'`) + "'"
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// CommandLine is an exec intent's argv as a shell command line, safe to
// print, cut at max runes (-1 for no cap).
func commandLine(d *execCommand, max int) string {
	if t := d.Truncated; t != nil {
		return clean(fmt.Sprintf("%s … (%d arguments, too large to record)", shellWord(t.Argv0), t.Args), max)
	}
	words := make([]string, len(d.Argv))
	for i, a := range d.Argv {
		words[i] = shellWord(a)
	}
	s := strings.Join(words, " ")
	if max >= 0 && utf8.RuneCountInString(s) > max {
		return string([]rune(s)[:max]) + "…"
	}
	return s
}

// Summary says in one line what a record is about: an exec's command
// line, an exit code, a decision and its rule, a file operation, a
// lifecycle event. It is safe to print.
func Summary(e *Entry) string {
	if s, ok := summary(e); ok {
		return s
	}
	return rawData(e)
}

func rawData(e *Entry) string {
	if len(e.Data) == 0 {
		return ""
	}
	return clean(string(e.Data), maxField)
}

func summary(e *Entry) (string, bool) {
	f := func(s string) string { return clean(s, maxField) }
	var parts []string
	add := func(format string, args ...any) { parts = append(parts, fmt.Sprintf(format, args...)) }
	sep := " "
	switch e.Kind {
	case audit.KindVMLifecycle:
		var d audit.Lifecycle
		if !decodeData(e, &d) || d.Event == "" {
			return "", false
		}
		sep = ", "
		add("%s", f(d.Event))
		if d.ImageName != "" || d.ImageDigest != "" {
			add("image %s", imageRef(d.ImageName, d.ImageDigest))
		}
		if d.RootHash != "" {
			add("root hash %s", shortHash(d.RootHash))
		}
		if d.Policy != "" || d.PolicyRevision != "" {
			add("policy %s", f(policyRef(d.Policy, d.PolicyRevision)))
		}
		if d.CPUs > 0 {
			add("%d cpus", d.CPUs)
		}
		if d.MemoryBytes > 0 {
			add("%s memory", bytesText(int64(d.MemoryBytes)))
		}
		if d.Driver != "" {
			add("driver %s", f(d.Driver))
		}
		if d.Reason != "" {
			add("reason: %s", f(d.Reason))
		}
	case audit.KindAPICall:
		var d audit.APICall
		if !decodeData(e, &d) || d.Procedure == "" {
			return "", false
		}
		add("%s", f(d.Procedure))
		if d.Code != "" {
			add("-> %s", f(d.Code))
		}
		if d.Error != "" {
			add("(%s)", f(d.Error))
		}
		if q := d.Quota; q != nil {
			add("over quota %s: %d held, %d asked, limit %d", f(q.Limit), q.Used, q.Asked, q.Max)
		}
		if d.DurationNs > 0 {
			add("in %s", time.Duration(d.DurationNs).Round(time.Microsecond))
		}
		if c := callerText(d.Caller); c != "" {
			add("by %s", c)
		}
	case audit.KindPolicyDecision:
		var d audit.Decision
		if !decodeData(e, &d) {
			return "", false
		}
		add("%s %s", verdict(d.Allow), f(d.Kind))
		add("rule %s", f(d.Rule))
		if d.Reason != "" {
			add("reason: %s", f(d.Reason))
		}
		add("[policy %s]", f(policyRef(d.Policy, d.Revision)))
		if d.Cached {
			add("(cached)")
		}
	case audit.KindIntent:
		if len(e.Data) == 0 {
			return "", false
		}
		v, err := audit.DecodeIntent(e.Data)
		if err != nil {
			return "", false
		}
		var caller *audit.Caller
		switch d := v.(type) {
		case *audit.ExecIntent:
			add("exec $ %s", commandLine(&execCommand{ExecIntent: *d}, maxField))
			var opts []string
			if d.Cwd != "" {
				opts = append(opts, "cwd "+f(d.Cwd))
			}
			if d.User != "" {
				opts = append(opts, "user "+f(d.User))
			}
			if d.TTY {
				opts = append(opts, "tty")
			}
			if d.Detach {
				opts = append(opts, "detached")
			}
			if len(opts) > 0 {
				add("(%s)", strings.Join(opts, ", "))
			}
			caller = &d.Caller
		case *audit.ExecIntentTruncated:
			add("exec $ %s", commandLine(&execCommand{Truncated: d}, maxField))
			caller = &d.Caller
		case *audit.ForwardIntent:
			add("%s", f(d.Action))
			add("port %d", d.Port)
			caller = &d.Caller
		case *audit.InputIntent:
			add("%s %s to command %s", f(d.Action), f(d.Input), f(d.ExecID))
			if d.Bytes > 0 {
				add("%s", bytesText(int64(d.Bytes)))
			}
			caller = &d.Caller
		case *audit.FileIntent:
			if d.Action == "" {
				return "", false
			}
			add("%s", f(d.Action))
			if d.Path != "" {
				add("%s", f(d.Path))
			}
			if d.To != "" {
				add("-> %s", f(d.To))
			}
			if d.Mode != 0 {
				add("mode %d", d.Mode)
			}
			if d.UID != nil {
				add("uid %d", *d.UID)
			}
			if d.GID != nil {
				add("gid %d", *d.GID)
			}
			if d.Tar {
				add("(tar)")
			}
			if d.Recursive {
				add("(recursive)")
			}
			caller = &d.Caller
		}
		if c := callerText(caller); c != "" {
			add("by %s", c)
		}
	case audit.KindExecExit:
		var d audit.ExecExit
		if !decodeData(e, &d) {
			return "", false
		}
		add("%s", exitText(&d))
		add("stdout %s, stderr %s", bytesText(d.StdoutBytes), bytesText(d.StderrBytes))
		if d.StdinBytes > 0 {
			add("stdin %s", bytesText(d.StdinBytes))
		}
	case audit.KindExecOutput:
		var d audit.ExecOutput
		if !decodeData(e, &d) {
			return "", false
		}
		add("%s %s at %d", f(d.Stream), bytesText(d.Size), d.Offset)
		add("of exec %d", d.Exec)
		if len(d.Chunks) > 1 {
			add("(%d chunks)", len(d.Chunks))
		}
	case audit.KindFileOp:
		var d audit.FileOp
		if !decodeData(e, &d) || d.Op == "" {
			return "", false
		}
		add("%s %s", f(d.Op), f(d.Path))
		if d.To != "" {
			add("-> %s", f(d.To))
		}
		add("%s", bytesText(d.Size))
		if d.Entries > 0 {
			add("%d entries", d.Entries)
		}
		if d.Digest != "" {
			add("%s", f(d.Digest))
		}
		if d.Content != "" {
			add("(content not kept: %s)", f(d.Content))
		}
		if d.Error != "" {
			add("error: %s", f(d.Error))
		}
	case audit.KindWatchEvent:
		var d audit.Watch
		if !decodeData(e, &d) || len(d.Events) == 0 {
			return "", false
		}
		add("%d events", len(d.Events))
		for i, ev := range d.Events {
			if i == 3 {
				add("…")
				break
			}
			add("%s %s", f(ev.Op), f(ev.Path))
			if ev.OldPath != "" {
				add("(from %s)", f(ev.OldPath))
			}
		}
		if d.Dropped > 0 {
			add("(%d dropped)", d.Dropped)
		}
	case audit.KindFileActivity:
		var d audit.Activity
		if !decodeData(e, &d) {
			return "", false
		}
		add("%d events", len(d.Events))
		for i, ev := range d.Events {
			if i == 3 {
				add("…")
				break
			}
			add("%s %s", f(ev.Op), f(ev.Path))
		}
		if d.Dropped > 0 {
			add("(%d dropped)", d.Dropped)
		}
	case audit.KindGPUAttach, audit.KindGPUDetach:
		var d audit.GPU
		if !decodeData(e, &d) || len(d.GPUs) == 0 {
			return "", false
		}
		for _, g := range d.GPUs {
			add("%s", f(g))
		}
		if d.Driver != "" {
			add("driver %s", f(d.Driver))
		}
		if d.Reason != "" {
			add("reason: %s", f(d.Reason))
		}
	case audit.KindNetEgress:
		var d audit.Egress
		if !decodeData(e, &d) || d.Host == "" {
			return "", false
		}
		add("%s %s:%d/%s", f(d.Outcome), f(d.Host), d.Port, f(d.Protocol))
		if d.IP != "" {
			add("via %s", f(d.IP))
		}
		if d.Rule != "" {
			add("rule %s", f(d.Rule))
		}
		if d.BytesUp > 0 || d.BytesDown > 0 {
			add("up %s, down %s", bytesText(d.BytesUp), bytesText(d.BytesDown))
		}
		if d.PID > 0 {
			add("pid %d", d.PID)
		}
		if d.Error != "" {
			add("error: %s", f(d.Error))
		}
	case audit.KindOutcome:
		// Open's outcome for an intent left open says what it was; the
		// other outcome carreld writes is a port-forward's.
		var u audit.OutcomeData
		if !decodeData(e, &u) {
			return "", false
		}
		if u.Outcome != "" {
			add("%s", f(u.Outcome))
			if u.Reason != "" {
				add("reason: %s", f(u.Reason))
			}
			break
		}
		var d audit.ForwardOutcome
		if !decodeData(e, &d) {
			return "", false
		}
		add("%s from the guest", bytesText(d.BytesFromGuest))
		if d.Error != "" {
			add("error: %s", f(d.Error))
		}
	case audit.KindRecovery:
		var d audit.RecoveryData
		if !decodeData(e, &d) || d.Cause == "" {
			return "", false
		}
		add("%s", f(d.Cause))
		if d.TruncatedBytes > 0 {
			add("cut a torn tail of %d bytes (%s)", d.TruncatedBytes, f(d.TailReason))
		}
		if d.UnknownOutcomes > 0 {
			add("%d actions' outcomes unknown", d.UnknownOutcomes)
		}
		if d.Since != nil {
			add("unavailable since %s", d.Since.UTC().Format(timeLayout))
		}
		if d.Refused > 0 {
			add("%d appends refused", d.Refused)
		}
		if d.Error != "" {
			add("error: %s", f(d.Error))
		}
	case audit.KindSegment:
		var d audit.SegmentStart
		if !decodeData(e, &d) || d.Previous == "" {
			return "", false
		}
		add("a new segment after %s (%d records, %s)", f(d.Previous), d.Records, bytesText(d.Bytes))
		if n := max(len(d.OpenIntents), d.OpenIntentsCount); n > 0 {
			add("%d intents open", n)
		}
	case audit.KindWitness:
		var d audit.WitnessEvent
		if !decodeData(e, &d) || d.Witness == "" {
			return "", false
		}
		add("witness %s %s at checkpoint %d", f(d.Witness), f(d.Outcome), d.Size)
		if d.Error != "" {
			add("error: %s", f(d.Error))
		}
	default:
		return "", false
	}
	s := strings.Join(parts, sep)
	if e.Intent != nil && e.Kind != audit.KindExecOutput {
		s += fmt.Sprintf(" (intent %d)", *e.Intent)
	}
	return s, true
}

// imageRef names an image in a line: its name, if recorded, and its
// digest cut to 12 hex digits (as carrel image ls shows it).
func imageRef(name, digest string) string {
	return strings.TrimSpace(clean(name, 64) + " " + shortHash(digest))
}

// shortHash is a digest ("sha256:…") or a hex hash cut to 12 hex digits,
// safe to print.
func shortHash(h string) string {
	if rest, ok := strings.CutPrefix(h, "sha256:"); ok {
		return "sha256:" + clean(rest, 12)
	}
	return clean(h, 12)
}

func verdict(allow bool) string {
	if allow {
		return "allow"
	}
	return "deny"
}

func policyRef(name, rev string) string {
	if rev == "" {
		return name
	}
	return name + "@" + rev
}

func exitText(d *audit.ExecExit) string {
	switch {
	case d.Code != nil:
		return fmt.Sprintf("exit %d", *d.Code)
	case d.Signal != "":
		return "killed by " + clean(d.Signal, maxField)
	case d.Error != "":
		return "no exit status: " + clean(d.Error, maxField)
	}
	return "no exit status"
}

func callerText(c *audit.Caller) string {
	if c == nil {
		return ""
	}
	switch {
	case c.TokenID != "":
		return "token " + clean(c.TokenID, maxField)
	case c.Type == audit.CallerKey:
		return "key " + clean(c.Name, maxField) + " (" + clean(c.KeyID, maxField) + ")"
	case c.Type == "peer" && c.PID != 0:
		return fmt.Sprintf("uid %d pid %d", c.UID, c.PID)
	case c.Type == "peer":
		return fmt.Sprintf("uid %d", c.UID)
	}
	return clean(c.Type, maxField)
}

// bytesText is a byte count for people.
func bytesText(n int64) string {
	switch {
	case n < 1<<10:
		return fmt.Sprintf("%d B", n)
	case n < 1<<20:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	case n < 1<<30:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	}
	return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
}

// timeLayout is how review tools print a record's time (UTC).
const timeLayout = "2006-01-02T15:04:05.000Z"

// SafeText is s made safe to print on a terminal: control characters,
// bidirectional overrides and bytes that are not UTF-8 escaped, and cut
// at 200 characters.
func SafeText(s string) string { return clean(s, maxField) }
