// Package review is the compliance reviewer's side of the audit log: it
// reads a log's files (read-only, through audit.Reader, so carreld may
// keep appending) and turns a session's records into a timeline, a
// terminal replay or asciicast, an evidence bundle that can be checked on
// another machine, and a self-contained HTML report.
//
// A session's records are those that name it, and those that name its VM
// but no session and were written while it ran. A command's output is in
// its exec.output records: each holds a run of one stream in a blob, cut
// into chunks timed from the exec intent's time. The image it ran on, with
// its packages, is in the image manifest its created or starting
// vm.lifecycle record keeps as a blob.
//
// Everything in a record may come from a hostile guest or caller: text
// for a terminal goes through clean or termFilter, and text for a page
// through html/template.
package review
