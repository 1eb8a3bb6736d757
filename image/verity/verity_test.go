package verity

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

var testUUID = [16]byte{0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x0f, 0xed, 0xcb, 0xa9, 0x87, 0x65, 0x43, 0x21}

// testData returns deterministic pseudo-random data of n bytes.
func testData(n int, seed uint64) []byte {
	b := make([]byte, n)
	var s [32]byte
	s[0], s[1] = byte(seed), byte(seed>>8)
	rand.NewChaCha8(s).Read(b)
	return b
}

func testParams(blocks uint64, salt []byte) Params {
	return Params{HashAlg: "sha256", DataBlockSize: 4096, HashBlockSize: 4096, DataBlocks: blocks, Salt: salt, UUID: testUUID}
}

func format(t testing.TB, data []byte, p Params) (hashDev, root []byte) {
	t.Helper()
	var buf bytes.Buffer
	root, err := Format(bytes.NewReader(data), int64(len(data)), p, &buf)
	if err != nil {
		t.Fatalf("Format: %v", err)
	}
	if int64(buf.Len()) != HashSize(p) {
		t.Fatalf("Format wrote %d bytes, HashSize says %d", buf.Len(), HashSize(p))
	}
	return buf.Bytes(), root
}

func verify(data, hashDev []byte, p Params, root []byte) error {
	return Verify(bytes.NewReader(data), int64(len(data)), bytes.NewReader(hashDev), int64(len(hashDev)), p, root)
}

// Output of veritysetup 2.6.1 for TestGolden's data and testUUID.
const (
	goldenRoot4096 = "90441ddfa7f65114fb8885589bef4b19e0db43592da5a0f6e7d364b2767d523f"
	goldenSum4096  = "b5f5033e79cd936c086003b08dc9f9ec1939e80c76ee7ee9d869bb56ab250d23"
	goldenRoot512  = "a61a12f35fff34f411fa80e77020b8ceb3072e0b69cbb456ef74d2c0505be6b8"
	goldenSum512   = "2a3c8a55a46f6bd74865fed84c25b5963718bf2537254e373fec2059b747e31e"
)

// TestGolden pins output that veritysetup 2.6.1 produced for this input, so
// byte identity is checked even where veritysetup is not installed.
func TestGolden(t *testing.T) {
	data := make([]byte, 300*4096)
	for i := range data {
		data[i] = byte(i * 7 / 4096)
	}
	for _, tc := range []struct {
		hashBlockSize uint32
		salt          string
		root, sum     string
	}{
		{4096, "", goldenRoot4096, goldenSum4096},
		{512, "000102030405060708090a0b0c0d0e0f", goldenRoot512, goldenSum512},
	} {
		salt, _ := hex.DecodeString(tc.salt)
		p := testParams(300, salt)
		p.HashBlockSize = tc.hashBlockSize
		dev, root := format(t, data, p)
		if got := hex.EncodeToString(root); got != tc.root {
			t.Errorf("hash block size %d: root hash %s, veritysetup gave %s", tc.hashBlockSize, got, tc.root)
		}
		if got := fmt.Sprintf("%x", sha256.Sum256(dev)); got != tc.sum {
			t.Errorf("hash block size %d: hash device sha256 %s, veritysetup's is %s", tc.hashBlockSize, got, tc.sum)
		}
	}
}

func TestOneDataBlock(t *testing.T) {
	data := testData(4096, 1)
	salt := []byte("salty")
	p := testParams(1, salt)
	dev, root := format(t, data, p)
	want := sha256.Sum256(append(bytes.Clone(salt), data...))
	if !bytes.Equal(root, want[:]) {
		t.Errorf("root hash %x, want H(salt||block) %x", root, want)
	}
	if len(dev) != 4096 {
		t.Errorf("hash device is %d bytes, want only the superblock block", len(dev))
	}
	if err := verify(data, dev, p, root); err != nil {
		t.Errorf("Verify: %v", err)
	}
}

func TestHashSize(t *testing.T) {
	// Sizes veritysetup reported for 300 blocks of 4096 bytes.
	for _, tc := range []struct {
		hashBlockSize uint32
		want          int64
	}{{512, 11776}, {1024, 12288}, {4096, 20480}, {8192, 32768}} {
		p := testParams(300, nil)
		p.HashBlockSize = tc.hashBlockSize
		if got := HashSize(p); got != tc.want {
			t.Errorf("HashSize with %d-byte hash blocks = %d, want %d", tc.hashBlockSize, got, tc.want)
		}
	}
	if got := HashSize(testParams(0, nil)); got != -1 {
		t.Errorf("HashSize of invalid params = %d, want -1", got)
	}
	// The largest data size int64 holds, and one block more.
	if got := HashSize(testParams(1<<51-1, nil)); got <= 0 || got > 1<<63/100 {
		t.Errorf("HashSize(2^51-1 blocks) = %d", got)
	}
	if got := HashSize(testParams(1<<51, nil)); got != -1 {
		t.Errorf("HashSize(2^51 blocks) = %d, want -1", got)
	}
}

func TestFormatRejects(t *testing.T) {
	data := testData(3*4096, 2)
	for _, tc := range []struct {
		name string
		size int64
		p    Params
	}{
		{"partial block", 3*4096 - 1, testParams(3, nil)},
		{"empty", 0, testParams(1, nil)},
		{"block count", 3 * 4096, testParams(2, nil)},
		{"zero blocks", 3 * 4096, testParams(0, nil)},
		{"algorithm", 3 * 4096, Params{HashAlg: "sha1", DataBlockSize: 4096, HashBlockSize: 4096, DataBlocks: 3}},
		{"block size", 3 * 4096, Params{HashAlg: "sha256", DataBlockSize: 4096, HashBlockSize: 3000, DataBlocks: 3}},
		{"small block", 3 * 4096, Params{HashAlg: "sha256", DataBlockSize: 256, HashBlockSize: 4096, DataBlocks: 48}},
		{"salt", 3 * 4096, testParams(3, make([]byte, 257))},
	} {
		_, err := Format(bytes.NewReader(data), tc.size, tc.p, &bytes.Buffer{})
		if !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: Format error %v, want ErrInvalid", tc.name, err)
		}
	}
}

func TestFormatReadError(t *testing.T) {
	data := testData(4*4096, 3)
	_, err := Format(bytes.NewReader(data[:2*4096]), int64(len(data)), testParams(4, nil), &bytes.Buffer{})
	if err == nil || errors.Is(err, ErrInvalid) {
		t.Errorf("Format of short data = %v, want a read error", err)
	}
}

func TestVerifyDetects(t *testing.T) {
	// 300 blocks with 512-byte hash blocks: three levels (19, 2, 1 blocks).
	data := testData(300*4096, 4)
	p := testParams(300, []byte("salt"))
	p.HashBlockSize = 512
	dev, root := format(t, data, p)
	if err := verify(data, dev, p, root); err != nil {
		t.Fatalf("Verify of intact image: %v", err)
	}
	const sbBlock = 512
	level0 := len(dev) - 19*512 // level 0 is last on the device

	flip := func(b []byte, i int) []byte {
		b = bytes.Clone(b)
		b[i] ^= 0x40
		return b
	}
	wrongRoot := flip(root, 0)
	otherSalt := p
	otherSalt.Salt = []byte("pepper")
	for _, tc := range []struct {
		name      string
		data, dev []byte
		p         Params
		root      []byte
		want      []string
	}{
		{"data byte", flip(data, 40*4096+7), dev, p, root, []string{"hash block 2 of level 0 differs", "hash block 0 of level 1 differs", "root hash is"}},
		{"level 0 byte", data, flip(dev, level0+5*512+100), p, root, []string{"hash block 5 of level 0 differs"}},
		{"top level byte", data, flip(dev, sbBlock+3), p, root, []string{"hash block 0 of level 2 differs"}},
		{"superblock uuid", data, flip(dev, offUUID+2), p, root, []string{"superblock uuid is"}},
		{"superblock data blocks", data, flip(dev, offDataBlocks), p, root, []string{"superblock data blocks is"}},
		{"superblock signature", data, flip(dev, 0), p, root, []string{"superblock: ", "bad signature"}},
		{"superblock padding", data, flip(dev, 400), p, root, []string{"byte 400 (padding)"}},
		{"root hash", data, dev, p, wrongRoot, []string{fmt.Sprintf("root hash is %x, manifest says %x", root, wrongRoot)}},
		{"salt", data, dev, otherSalt, root, []string{"superblock salt is 73616c74, manifest says 70657070657", "hash block 0 of level 0 differs", "16 more hash blocks of level 0 differ"}},
		{"data size", data[:len(data)-4096], dev, p, root, []string{"data holds 299 blocks"}},
		{"hash size", data, append(bytes.Clone(dev), 0), p, root, []string{"hash device is"}},
	} {
		err := verify(tc.data, tc.dev, tc.p, tc.root)
		if !errors.Is(err, ErrMismatch) {
			t.Errorf("%s: Verify = %v, want ErrMismatch", tc.name, err)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: Verify error %q does not mention %q", tc.name, err, w)
			}
		}
	}
}

func TestReadSuperblockRoundTrip(t *testing.T) {
	for _, p := range []Params{
		testParams(1, nil),
		testParams(12345, bytes.Repeat([]byte{0xa5}, 32)),
		{HashAlg: "sha256", DataBlockSize: 512, HashBlockSize: 65536, DataBlocks: 7, Salt: bytes.Repeat([]byte{1}, 256)},
	} {
		var sb bytes.Buffer
		sb.Write(p.marshalSuperblock())
		got, err := ReadSuperblock(bytes.NewReader(sb.Bytes()))
		if err != nil {
			t.Fatalf("ReadSuperblock: %v", err)
		}
		if !paramsEqual(got, p) {
			t.Errorf("ReadSuperblock = %+v, want %+v", got, p)
		}
	}
}

func paramsEqual(a, b Params) bool {
	return a.HashAlg == b.HashAlg && a.DataBlockSize == b.DataBlockSize && a.HashBlockSize == b.HashBlockSize &&
		a.DataBlocks == b.DataBlocks && bytes.Equal(a.Salt, b.Salt) && a.UUID == b.UUID
}

func TestReadSuperblockRejects(t *testing.T) {
	good := testParams(10, []byte{1, 2, 3}).marshalSuperblock()
	set := func(off int, v ...byte) []byte {
		b := bytes.Clone(good)
		copy(b[off:], v)
		return b
	}
	for _, tc := range []struct {
		name string
		sb   []byte
		want string
	}{
		{"truncated", good[:511], "truncated"},
		{"signature", set(6, 'x'), "signature"},
		{"version", set(offVersion, 2), "version 2"},
		{"hash type", set(offHashType, 0), "hash type 0"},
		{"algorithm", set(offAlgorithm, 's', 'h', 'a', '1', 0), "sha1"},
		{"algorithm unterminated", set(offAlgorithm, bytes.Repeat([]byte{'a'}, 32)...), "NUL"},
		{"data block size", set(offDataBlockSize, 0, 0x30), "data block size 12288"},
		{"hash block size", set(offHashBlockSize, 0, 1), "hash block size 256"},
		{"big block size", set(offHashBlockSize, 0, 0, 2), "hash block size 131072"},
		{"salt size", set(offSaltSize, 1, 1), "salt size 257"},
		{"zero data blocks", set(offDataBlocks, 0, 0, 0, 0, 0, 0, 0, 0), "zero data blocks"},
		{"absurd data blocks", set(offDataBlocks, 0, 0, 0, 0, 0, 0, 0, 1), "overflow"},
	} {
		_, err := ReadSuperblock(bytes.NewReader(tc.sb))
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: ReadSuperblock error %v, want ErrInvalid mentioning %q", tc.name, err, tc.want)
		}
	}
}

func FuzzReadSuperblock(f *testing.F) {
	f.Add(testParams(1, nil).marshalSuperblock())
	f.Add(testParams(16385, bytes.Repeat([]byte{7}, 32)).marshalSuperblock())
	f.Add(Params{HashAlg: "sha256", DataBlockSize: 512, HashBlockSize: 65536, DataBlocks: 1 << 40, Salt: make([]byte, 256)}.marshalSuperblock())
	f.Add([]byte("verity\x00\x00\x01\x00\x00\x00\x01\x00\x00\x00"))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		p, err := ReadSuperblock(bytes.NewReader(b))
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v does not wrap ErrInvalid", err)
			}
			return
		}
		if err := p.Validate(); err != nil {
			t.Fatalf("accepted invalid params: %v", err)
		}
		if HashSize(p) <= int64(p.HashBlockSize) && p.DataBlocks > 1 {
			t.Fatalf("HashSize(%+v) = %d", p, HashSize(p))
		}
		again, err := ReadSuperblock(bytes.NewReader(p.marshalSuperblock()))
		if err != nil || !paramsEqual(again, p) {
			t.Fatalf("round trip of %+v gave %+v, %v", p, again, err)
		}
	})
}

func TestTable(t *testing.T) {
	root := bytes.Repeat([]byte{0xab}, 32)
	p := testParams(262144, nil)
	want := "1 /dev/vda 253:0 4096 4096 262144 1 sha256 " + strings.Repeat("ab", 32) + " -"
	if got := Table("/dev/vda", "253:0", p, root); got != want {
		t.Errorf("Table =\n%q, want\n%q", got, want)
	}
	p.Salt = []byte{0, 0xff}
	if got := Table("a", "b", p, root); !strings.HasSuffix(got, " 00ff") {
		t.Errorf("Table with salt = %q", got)
	}
}

// veritysetup returns the oracle's path, skipping the test without it.
func veritysetup(t *testing.T) string {
	t.Helper()
	path, err := exec.LookPath("veritysetup")
	if err != nil {
		t.Skip("veritysetup not in PATH (Debian package cryptsetup-bin); skipping oracle comparison")
	}
	return path
}

func uuidString(u [16]byte) string {
	h := hex.EncodeToString(u[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

// oracleFormat runs veritysetup format on the data file and returns the hash
// device it wrote and the root hash it printed.
func oracleFormat(t *testing.T, bin, dataPath string, p Params) (dev, root []byte) {
	t.Helper()
	dir := t.TempDir()
	hashPath, rootPath := filepath.Join(dir, "hash"), filepath.Join(dir, "root")
	cmd := exec.Command(bin, "format", "--hash="+p.HashAlg,
		fmt.Sprintf("--data-block-size=%d", p.DataBlockSize), fmt.Sprintf("--hash-block-size=%d", p.HashBlockSize),
		fmt.Sprintf("--data-blocks=%d", p.DataBlocks),
		"--salt="+hexOrDash(p.Salt), "--uuid="+uuidString(p.UUID), "--root-hash-file="+rootPath,
		dataPath, hashPath)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("veritysetup format: %v\n%s", err, out)
	}
	dev, err := os.ReadFile(hashPath)
	if err != nil {
		t.Fatal(err)
	}
	rootHex, err := os.ReadFile(rootPath)
	if err != nil {
		t.Fatal(err)
	}
	root, err = hex.DecodeString(strings.TrimSpace(string(rootHex)))
	if err != nil {
		t.Fatalf("veritysetup root hash %q: %v", rootHex, err)
	}
	return dev, root
}

func TestOracleFormat(t *testing.T) {
	bin := veritysetup(t)
	salt32 := testData(32, 99)
	type shape struct{ dataBlockSize, hashBlockSize uint32 }
	for _, tc := range []struct {
		blocks uint64
		shapes []shape
	}{
		{1, []shape{{4096, 4096}}},
		{2, []shape{{4096, 4096}}},
		{127, []shape{{4096, 4096}}},
		{128, []shape{{4096, 4096}, {512, 4096}}},
		{129, []shape{{4096, 4096}, {4096, 512}, {1024, 65536}}},
		{777, []shape{{4096, 4096}, {4096, 1024}}}, // ~3 MiB
		{128 * 128, []shape{{4096, 4096}}},
		{128*128 + 1, []shape{{4096, 4096}}},
	} {
		for _, sh := range tc.shapes {
			data := testData(int(tc.blocks)*int(sh.dataBlockSize), tc.blocks)
			dataPath := filepath.Join(t.TempDir(), "data")
			if err := os.WriteFile(dataPath, data, 0o600); err != nil {
				t.Fatal(err)
			}
			for _, salt := range [][]byte{nil, salt32} {
				p := testParams(tc.blocks, salt)
				p.DataBlockSize, p.HashBlockSize = sh.dataBlockSize, sh.hashBlockSize
				name := fmt.Sprintf("%d blocks of %d, hash blocks %d, salt %d bytes", tc.blocks, sh.dataBlockSize, sh.hashBlockSize, len(salt))
				wantDev, wantRoot := oracleFormat(t, bin, dataPath, p)
				dev, root := format(t, data, p)
				if !bytes.Equal(root, wantRoot) {
					t.Errorf("%s: root hash %x, veritysetup %x", name, root, wantRoot)
				}
				if !bytes.Equal(dev, wantDev) {
					t.Errorf("%s: hash device differs from veritysetup's (%d vs %d bytes, first difference at %d)",
						name, len(dev), len(wantDev), firstDiff(dev, wantDev))
				}
			}
		}
	}
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

func TestOracleVerify(t *testing.T) {
	bin := veritysetup(t)
	dir := t.TempDir()
	data := testData(129*4096, 5)
	p := testParams(129, []byte("0123456789abcdef0123456789abcdef"))
	dev, root := format(t, data, p)
	dataPath, hashPath := filepath.Join(dir, "data"), filepath.Join(dir, "hash")
	if err := os.WriteFile(dataPath, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(hashPath, dev, 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(bin, "verify", dataPath, hashPath, hex.EncodeToString(root)).CombinedOutput(); err != nil {
		t.Fatalf("veritysetup verify of Format's output: %v\n%s", err, out)
	}
	// The oracle must also notice damage, or the check above proves nothing.
	dev[len(dev)-1] ^= 1
	if err := os.WriteFile(hashPath, dev, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := exec.Command(bin, "verify", dataPath, hashPath, hex.EncodeToString(root)).Run(); err == nil {
		t.Fatal("veritysetup verify accepted a damaged hash device")
	}
}

func BenchmarkFormat(b *testing.B) {
	const size = 256 << 20
	data := make([]byte, size)
	for i := 0; i < size; i += 4096 {
		data[i] = byte(i >> 12)
	}
	p := testParams(size/4096, testData(32, 1))
	b.SetBytes(size)
	for b.Loop() {
		if _, err := Format(bytes.NewReader(data), size, p, discard{}); err != nil {
			b.Fatal(err)
		}
	}
}

type discard struct{}

func (discard) Write(b []byte) (int, error) { return len(b), nil }
