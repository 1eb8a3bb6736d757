package verity

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"math"
)

// The on-disk struct verity_sb of cryptsetup's hash format version 1:
// 512 bytes, little-endian, at offset 0 of the hash device.
const (
	superblockSize = 512

	offSignature     = 0   // [8]byte "verity\0\0"
	offVersion       = 8   // u32, always 1
	offHashType      = 12  // u32, 1 = the format the kernel calls version 1
	offUUID          = 16  // [16]byte
	offAlgorithm     = 32  // [32]byte, NUL padded
	offDataBlockSize = 64  // u32
	offHashBlockSize = 68  // u32
	offDataBlocks    = 72  // u64
	offSaltSize      = 80  // u16, then 6 bytes of padding
	offSalt          = 88  // [256]byte, then 168 bytes of padding
	algorithmSize    = 32  //
	superblockEnd    = 344 // end of the salt field; the rest is padding
)

var signature = [8]byte{'v', 'e', 'r', 'i', 't', 'y', 0, 0}

// marshalSuperblock encodes p, which must be valid, as a verity_sb.
func (p Params) marshalSuperblock() []byte {
	b := make([]byte, superblockSize)
	copy(b[offSignature:], signature[:])
	le := binary.LittleEndian
	le.PutUint32(b[offVersion:], 1)
	le.PutUint32(b[offHashType:], 1)
	copy(b[offUUID:], p.UUID[:])
	copy(b[offAlgorithm:offAlgorithm+algorithmSize], p.HashAlg)
	le.PutUint32(b[offDataBlockSize:], p.DataBlockSize)
	le.PutUint32(b[offHashBlockSize:], p.HashBlockSize)
	le.PutUint64(b[offDataBlocks:], p.DataBlocks)
	le.PutUint16(b[offSaltSize:], uint16(len(p.Salt)))
	copy(b[offSalt:], p.Salt)
	return b
}

// ReadSuperblock parses the version-1 superblock at offset 0 of a hash
// device. It returns only Params that Format accepts; anything else (bad
// signature, version or hash type other than 1, an algorithm other than
// sha256, block sizes that are not powers of two in [512, 65536], a salt
// longer than 256 bytes, zero data blocks or a data size beyond int64) is an
// error wrapping ErrInvalid. Padding bytes are not checked here; Verify
// compares the whole superblock block byte for byte.
func ReadSuperblock(r io.ReaderAt) (Params, error) {
	b := make([]byte, superblockSize)
	n, err := r.ReadAt(b, 0)
	if n < len(b) {
		if err == nil || err == io.EOF {
			return Params{}, fmt.Errorf("%w: superblock truncated at %d of %d bytes", ErrInvalid, n, len(b))
		}
		return Params{}, fmt.Errorf("read verity superblock: %w", err)
	}
	return parseSuperblock(b)
}

func parseSuperblock(b []byte) (Params, error) {
	le := binary.LittleEndian
	if !bytes.Equal(b[offSignature:offSignature+len(signature)], signature[:]) {
		return Params{}, fmt.Errorf("%w: bad signature %q", ErrInvalid, b[offSignature:offSignature+len(signature)])
	}
	if v := le.Uint32(b[offVersion:]); v != 1 {
		return Params{}, fmt.Errorf("%w: superblock version %d, want 1", ErrInvalid, v)
	}
	if t := le.Uint32(b[offHashType:]); t != 1 {
		return Params{}, fmt.Errorf("%w: hash type %d, want 1", ErrInvalid, t)
	}
	alg := b[offAlgorithm : offAlgorithm+algorithmSize]
	end := bytes.IndexByte(alg, 0)
	if end < 0 {
		return Params{}, fmt.Errorf("%w: algorithm name is not NUL terminated", ErrInvalid)
	}
	saltSize := le.Uint16(b[offSaltSize:])
	if saltSize > MaxSaltSize {
		return Params{}, fmt.Errorf("%w: salt size %d exceeds %d", ErrInvalid, saltSize, MaxSaltSize)
	}
	p := Params{
		HashAlg:       string(alg[:end]),
		DataBlockSize: le.Uint32(b[offDataBlockSize:]),
		HashBlockSize: le.Uint32(b[offHashBlockSize:]),
		DataBlocks:    le.Uint64(b[offDataBlocks:]),
	}
	if saltSize > 0 {
		p.Salt = bytes.Clone(b[offSalt : offSalt+int(saltSize)])
	}
	copy(p.UUID[:], b[offUUID:])
	if err := p.Validate(); err != nil {
		return Params{}, err
	}
	return p, nil
}

// Validate reports, wrapping ErrInvalid, why Format cannot use p.
func (p Params) Validate() error {
	if p.HashAlg != "sha256" {
		return fmt.Errorf("%w: hash algorithm %q, only sha256 is supported", ErrInvalid, p.HashAlg)
	}
	if !validBlockSize(p.DataBlockSize) {
		return fmt.Errorf("%w: data block size %d is not a power of two in [%d, %d]", ErrInvalid, p.DataBlockSize, MinBlockSize, MaxBlockSize)
	}
	if !validBlockSize(p.HashBlockSize) {
		return fmt.Errorf("%w: hash block size %d is not a power of two in [%d, %d]", ErrInvalid, p.HashBlockSize, MinBlockSize, MaxBlockSize)
	}
	if len(p.Salt) > MaxSaltSize {
		return fmt.Errorf("%w: salt is %d bytes, at most %d allowed", ErrInvalid, len(p.Salt), MaxSaltSize)
	}
	if p.DataBlocks == 0 {
		return fmt.Errorf("%w: zero data blocks", ErrInvalid)
	}
	// Keeping the data size within int64 also keeps the tree's size, which is
	// smaller, within int64 for every block size allowed here.
	if p.DataBlocks > math.MaxInt64/uint64(p.DataBlockSize) {
		return fmt.Errorf("%w: %d data blocks of %d bytes overflow int64", ErrInvalid, p.DataBlocks, p.DataBlockSize)
	}
	return nil
}

func validBlockSize(n uint32) bool {
	return n >= MinBlockSize && n <= MaxBlockSize && n&(n-1) == 0
}
