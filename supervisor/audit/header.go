package audit

import (
	"bytes"
	"encoding/json"
	"errors"
	"strconv"
)

// header is what recovery and verification read from a payload. Its byte
// slices point into the payload.
type header struct {
	seq        uint64
	time       []byte
	kind       []byte
	vm         []byte
	session    []byte
	provenance []byte
	intent     uint64
	hasIntent  bool
	blobs      []string
	data       []byte // raw JSON; nil when absent
	canonical  bool   // parsed by the fast path (data not yet validated)
}

var errHeader = errors.New("record is not a JSON object with a numeric seq")

// parseHeader reads the fields of a payload. Payloads the log writes
// take a fast path over the fixed field order; anything else falls back
// to encoding/json, so the result is always what encoding/json says.
// On the fast path the data value is not validated: callers that must
// know call h.validData.
func parseHeader(p []byte, h *header) error {
	*h = header{blobs: h.blobs[:0]}
	if parseCanonical(p, h) {
		h.canonical = true
		return nil
	}
	*h = header{blobs: h.blobs[:0]}
	return parseSlow(p, h)
}

// validData reports whether the data value is one JSON value. Only the
// fast path leaves this unchecked: it stops at "data" and takes the rest,
// so a duplicate key after it would otherwise go unseen.
func (h *header) validData() bool {
	return !h.canonical || h.data == nil || validJSON(h.data)
}

func parseSlow(p []byte, h *header) error {
	var r struct {
		Seq        *uint64         `json:"seq"`
		Time       string          `json:"time"`
		Kind       string          `json:"kind"`
		VM         string          `json:"vm"`
		Session    string          `json:"session"`
		Provenance string          `json:"provenance"`
		Intent     *uint64         `json:"intent"`
		Blobs      []string        `json:"blobs"`
		Data       json.RawMessage `json:"data"`
	}
	if err := json.Unmarshal(p, &r); err != nil || r.Seq == nil {
		return errHeader
	}
	h.seq = *r.Seq
	h.time, h.kind, h.vm, h.session, h.provenance = []byte(r.Time), []byte(r.Kind), []byte(r.VM), []byte(r.Session), []byte(r.Provenance)
	if r.Intent != nil {
		h.intent, h.hasIntent = *r.Intent, true
	}
	h.blobs = append(h.blobs, r.Blobs...)
	h.data = r.Data
	return nil
}

// parseCanonical parses the encoding appendPayload writes. It returns
// false, leaving h in any state, for anything it does not recognise.
func parseCanonical(p []byte, h *header) bool {
	c := cursor{p: p}
	if !c.lit(`{"seq":`) {
		return false
	}
	var ok bool
	if h.seq, ok = c.uint(); !ok || !c.lit(`,"time":`) {
		return false
	}
	if h.time, ok = c.str(); !ok || !c.lit(`,"kind":`) {
		return false
	}
	if h.kind, ok = c.str(); !ok {
		return false
	}
	if c.lit(`,"vm":`) {
		if h.vm, ok = c.str(); !ok {
			return false
		}
	}
	if c.lit(`,"session":`) {
		if h.session, ok = c.str(); !ok {
			return false
		}
	}
	if !c.lit(`,"provenance":`) {
		return false
	}
	if h.provenance, ok = c.str(); !ok {
		return false
	}
	if c.lit(`,"intent":`) {
		if h.intent, ok = c.uint(); !ok {
			return false
		}
		h.hasIntent = true
	}
	if c.lit(`,"blobs":[`) {
		for {
			b, ok := c.str()
			if !ok {
				return false
			}
			h.blobs = append(h.blobs, string(b))
			if c.lit(`]`) {
				break
			}
			if !c.lit(`,`) {
				return false
			}
		}
	}
	if c.lit(`,"data":`) {
		if len(c.p)-c.i < 2 || p[len(p)-1] != '}' {
			return false
		}
		h.data = p[c.i : len(p)-1]
		return true
	}
	return c.lit(`}`) && c.i == len(p)
}

type cursor struct {
	p []byte
	i int
}

func (c *cursor) lit(s string) bool {
	if len(c.p)-c.i < len(s) || string(c.p[c.i:c.i+len(s)]) != s {
		return false
	}
	c.i += len(s)
	return true
}

// uint parses a JSON number that is a uint64 without leading zeros.
func (c *cursor) uint() (uint64, bool) {
	j := c.i
	for j < len(c.p) && '0' <= c.p[j] && c.p[j] <= '9' {
		j++
	}
	if j == c.i || j-c.i > 20 || c.p[c.i] == '0' && j-c.i > 1 {
		return 0, false
	}
	if j < len(c.p) && (c.p[j] == '.' || c.p[j] == 'e' || c.p[j] == 'E') {
		return 0, false
	}
	n, err := strconv.ParseUint(string(c.p[c.i:j]), 10, 64)
	if err != nil {
		return 0, false
	}
	c.i = j
	return n, true
}

// str parses a JSON string of printable ASCII without escapes; anything
// else is left to encoding/json.
func (c *cursor) str() ([]byte, bool) {
	if c.i >= len(c.p) || c.p[c.i] != '"' {
		return nil, false
	}
	k := bytes.IndexByte(c.p[c.i+1:], '"')
	if k < 0 {
		return nil, false
	}
	s := c.p[c.i+1 : c.i+1+k]
	for _, b := range s {
		if b < 0x20 || b >= 0x7f || b == '\\' {
			return nil, false
		}
	}
	c.i += k + 2
	return s, true
}
