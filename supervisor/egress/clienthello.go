package egress

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// The first bytes a program sends through a tunnel are checked before
// any of them leave the host: if they are a TLS ClientHello, the server
// name it asks for (SNI) must be the host the tunnel was decided for, so
// that a tunnel to an allowed name cannot carry a handshake for another
// (domain fronting at the TLS layer).

// MaxClientHelloBytes caps what is buffered while a ClientHello is read:
// records and handshake message together. Real ones, post-quantum key
// shares included, are a few KiB.
const MaxClientHelloBytes = 32 << 10

var (
	// ErrNotTLS: the bytes do not start a TLS handshake record.
	ErrNotTLS = errors.New("not a TLS handshake")
	// ErrNeedMore: the bytes are a valid start of a ClientHello that is not
	// complete yet.
	ErrNeedMore = errors.New("incomplete ClientHello")
	// ErrMalformed wraps every way a handshake that claims to be TLS fails
	// to be a well-formed ClientHello.
	ErrMalformed = errors.New("malformed TLS ClientHello")
)

// ClientHello is what the check needs of a ClientHello.
type ClientHello struct {
	// ServerName is the host_name of the server_name extension, as sent;
	// empty when there is none.
	ServerName string
	// ECH: the hello carries an encrypted_client_hello extension, so
	// ServerName is only its public (outer) name.
	ECH bool
	// Len is how many bytes of the input the hello's records took.
	Len int
}

const (
	recordHandshake     = 22
	handshakeClientHelo = 1
	extServerName       = 0
	extECH              = 0xfe0d
	maxRecordPayload    = 16384 + 2048 // RFC 8446 5.2: TLSCiphertext's bound; plaintext is 16384
)

// ParseClientHello reads a ClientHello from the start of b, which may span
// several TLS records. It returns ErrNotTLS when b does not start with a
// handshake record, ErrNeedMore when b is a valid but incomplete start, and
// an error wrapping ErrMalformed for anything else that is not a
// well-formed ClientHello. It never reads beyond MaxClientHelloBytes.
func ParseClientHello(b []byte) (ClientHello, error) {
	if len(b) == 0 {
		return ClientHello{}, ErrNeedMore
	}
	if b[0] != recordHandshake {
		return ClientHello{}, ErrNotTLS
	}
	// Gather the handshake message from as many records as it spans.
	var msg []byte
	off := 0
	want := -1 // the handshake message's length with its 4-byte header, once known
	for {
		if off+5 > len(b) {
			return ClientHello{}, need(len(b))
		}
		typ, ver, n := b[off], binary.BigEndian.Uint16(b[off+1:]), int(binary.BigEndian.Uint16(b[off+3:]))
		if typ != recordHandshake {
			return ClientHello{}, fmt.Errorf("%w: a record of type %d inside the hello", ErrMalformed, typ)
		}
		if ver>>8 != 3 {
			return ClientHello{}, fmt.Errorf("%w: record version %#04x", ErrMalformed, ver)
		}
		if n == 0 || n > maxRecordPayload {
			return ClientHello{}, fmt.Errorf("%w: a record of %d bytes", ErrMalformed, n)
		}
		if off+5+n > MaxClientHelloBytes {
			return ClientHello{}, fmt.Errorf("%w: over %d bytes", ErrMalformed, MaxClientHelloBytes)
		}
		if off+5+n > len(b) {
			return ClientHello{}, need(len(b))
		}
		msg = append(msg, b[off+5:off+5+n]...)
		off += 5 + n
		if want < 0 && len(msg) >= 4 {
			if msg[0] != handshakeClientHelo {
				return ClientHello{}, fmt.Errorf("%w: handshake type %d, not ClientHello", ErrMalformed, msg[0])
			}
			want = 4 + (int(msg[1])<<16 | int(msg[2])<<8 | int(msg[3]))
			if want > MaxClientHelloBytes {
				return ClientHello{}, fmt.Errorf("%w: a ClientHello of %d bytes", ErrMalformed, want)
			}
		}
		if want >= 0 && len(msg) >= want {
			if len(msg) > want {
				// The hello's last record holds more: another handshake
				// message, which a client may not send before the server's.
				return ClientHello{}, fmt.Errorf("%w: %d bytes after the ClientHello in its record", ErrMalformed, len(msg)-want)
			}
			h, err := parseHelloBody(msg[4:want])
			h.Len = off
			return h, err
		}
	}
}

// need is ErrNeedMore, unless b is already as long as a hello may be.
func need(n int) error {
	if n >= MaxClientHelloBytes {
		return fmt.Errorf("%w: over %d bytes", ErrMalformed, MaxClientHelloBytes)
	}
	return ErrNeedMore
}

// reader reads the big-endian fields of a hello; the first short read
// sets bad, and every read after it returns zeros.
type reader struct {
	b   []byte
	bad bool
}

func (r *reader) bytes(n int) []byte {
	if r.bad || n > len(r.b) {
		r.bad = true
		return nil
	}
	v := r.b[:n]
	r.b = r.b[n:]
	return v
}

func (r *reader) u8() int {
	v := r.bytes(1)
	if v == nil {
		return 0
	}
	return int(v[0])
}

func (r *reader) u16() int {
	v := r.bytes(2)
	if v == nil {
		return 0
	}
	return int(binary.BigEndian.Uint16(v))
}

// vec reads a vector with a length prefix of size bytes (1 or 2).
func (r *reader) vec(size int) *reader {
	var n int
	if size == 2 {
		n = r.u16()
	} else {
		n = r.u8()
	}
	return &reader{b: r.bytes(n), bad: r.bad}
}

// parseHelloBody reads a ClientHello's body (RFC 8446 4.1.2).
func parseHelloBody(body []byte) (ClientHello, error) {
	r := &reader{b: body}
	version := r.u16()
	r.bytes(32) // random
	sid := r.vec(1)
	suites := r.vec(2)
	comp := r.vec(1)
	switch {
	case r.bad || sid.bad || suites.bad || comp.bad:
		return ClientHello{}, fmt.Errorf("%w: truncated", ErrMalformed)
	case version>>8 != 3:
		return ClientHello{}, fmt.Errorf("%w: legacy_version %#04x", ErrMalformed, version)
	case len(sid.b) > 32:
		return ClientHello{}, fmt.Errorf("%w: a session id of %d bytes", ErrMalformed, len(sid.b))
	case len(suites.b) < 2 || len(suites.b)%2 != 0:
		return ClientHello{}, fmt.Errorf("%w: %d bytes of cipher suites", ErrMalformed, len(suites.b))
	case len(comp.b) < 1:
		return ClientHello{}, fmt.Errorf("%w: no compression methods", ErrMalformed)
	}
	var h ClientHello
	if len(r.b) == 0 {
		return h, nil // no extensions (SSL 3.0-style hello)
	}
	exts := r.vec(2)
	if exts.bad || len(r.b) != 0 {
		return ClientHello{}, fmt.Errorf("%w: extensions do not fill the hello", ErrMalformed)
	}
	seen := map[int]bool{}
	for len(exts.b) > 0 {
		typ := exts.u16()
		data := exts.vec(2)
		if exts.bad || data.bad {
			return ClientHello{}, fmt.Errorf("%w: truncated extension", ErrMalformed)
		}
		if seen[typ] {
			return ClientHello{}, fmt.Errorf("%w: extension %d twice", ErrMalformed, typ)
		}
		seen[typ] = true
		switch typ {
		case extServerName:
			name, err := parseServerName(data)
			if err != nil {
				return ClientHello{}, err
			}
			h.ServerName = name
		case extECH:
			h.ECH = true
		}
	}
	return h, nil
}

// parseServerName reads a server_name extension (RFC 6066 3): a list with
// one host_name, which must be ASCII letters, digits, '-', '_' and '.'.
func parseServerName(data *reader) (string, error) {
	list := data.vec(2)
	if data.bad || list.bad || len(data.b) != 0 || len(list.b) == 0 {
		return "", fmt.Errorf("%w: a server_name extension of the wrong size", ErrMalformed)
	}
	name := ""
	for len(list.b) > 0 {
		typ := list.u8()
		v := list.vec(2)
		if list.bad || v.bad {
			return "", fmt.Errorf("%w: truncated server_name", ErrMalformed)
		}
		if typ != 0 {
			continue // not host_name: no other type is defined
		}
		if name != "" {
			return "", fmt.Errorf("%w: two host names in server_name", ErrMalformed)
		}
		if len(v.b) == 0 || len(v.b) > 255 {
			return "", fmt.Errorf("%w: a host name of %d bytes", ErrMalformed, len(v.b))
		}
		for _, c := range v.b {
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
				return "", fmt.Errorf("%w: host name %.64q", ErrMalformed, v.b)
			}
		}
		name = string(v.b)
	}
	if name == "" {
		return "", fmt.Errorf("%w: server_name without a host name", ErrMalformed)
	}
	return name, nil
}
