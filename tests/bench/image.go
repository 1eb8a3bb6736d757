package main

import (
	"bytes"
	"connectrpc.com/connect"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/image/store"
	"github.com/carrel-os/carrel/image/sysroot"
	"github.com/carrel-os/carrel/supervisor/agentlink"
	"github.com/carrel-os/carrel/tests/harness"
)

// benchImageBuild times `carrel image build agent` three ways: cold (a
// carreld with an empty package cache, so everything is downloaded), warm
// (packages cached, the build run again with --no-cache) and cached (the
// same inputs: nothing is built), and prints the image's size. It leaves
// the agent image in d's store.
func benchImageBuild(t *tb, d *harness.Daemon) *store.Resolved {
	cache, err := os.MkdirTemp("/var/tmp", "carrel-bench-cache-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(cache)
	cold := harness.New(t, "--driver", "qemu", "--cache-dir", cache)
	cold.Start()
	timeBuild := func(d *harness.Daemon, args ...string) (time.Duration, string) {
		start := time.Now()
		r := d.CarrelTimeout(30*time.Minute, append([]string{"image", "build", "agent"}, args...)...)
		if r.Code != 0 {
			t.Fatalf("image build agent %v: %s", args, r.Stderr)
		}
		return time.Since(start), strings.TrimSpace(r.Stdout)
	}
	coldT, coldD := timeBuild(cold)
	cold.Stop()
	warmT, warmD := timeBuild(d, "--no-cache")
	cachedT, cachedD := timeBuild(d)
	st, err := store.Open(filepath.Join(d.State, "images"))
	if err != nil {
		t.Fatal(err)
	}
	img, err := st.Resolve("agent")
	if err != nil {
		t.Fatal(err)
	}
	m := img.Manifest
	fmt.Printf("\nimage build agent (%d packages): cold cache %v, warm cache %v, cached %v; same digest all three: %v\n",
		len(m.Packages), coldT.Round(time.Second), warmT.Round(time.Second), cachedT.Round(10*time.Millisecond),
		coldD == warmD && warmD == cachedD)
	fmt.Printf("image size: root (erofs, %s) %d MiB, hash tree %.1f MiB, kernel %.1f MiB, initrd %.1f MiB\n",
		orNone(m.Verity.Mount), m.System.Size>>20, float64(m.SystemVerity.Size)/(1<<20), float64(m.Kernel.Size)/(1<<20), float64(m.Initrd.Size)/(1<<20))
	return img
}

func orNone(s string) string {
	if s == "" {
		return "none"
	}
	return s
}

// benchAgentBoot boots, alternating, the agent image through carreld, the
// dev image through carreld, and the agent image with bare QEMU and the
// same disks, to agent-ready; then times the first `python3 -c pass` in a
// fresh agent VM against `true`.
func benchAgentBoot(t *tb, d *harness.Daemon, agent *store.Resolved, machine string, rounds int) {
	kinds := []string{"agent image", "dev image", "bare qemu (agent image)"}
	boot := func(k, name string) time.Duration {
		switch k {
		case "bare qemu (agent image)":
			took, err := bareBoot(machine, agent, 1024)
			if err != nil {
				t.Fatal(err)
			}
			return took
		}
		img := "agent"
		if k == "dev image" {
			img = "dev"
		}
		start := time.Now()
		d.Must("vm", "create", name, "--image", img, "--memory", "1G", "--cpus", "1")
		took := time.Since(start)
		d.Must("vm", "rm", "--force", name)
		return took
	}
	fmt.Printf("\nboot to agent-ready, 1 GiB, 1 vCPU, machine %s, %d rounds, order rotating:\n", machine, rounds)
	times := map[string][]time.Duration{}
	for i := 0; i < rounds; i++ {
		var line []string
		for j := range kinds {
			k := kinds[(i+j)%len(kinds)]
			took := boot(k, fmt.Sprintf("ab%d", i))
			times[k] = append(times[k], took)
			line = append(line, fmt.Sprintf("%s %v", k, took.Round(time.Millisecond)))
		}
		fmt.Printf("  round %d: %s\n", i+1, strings.Join(line, ", "))
	}
	ma, md, mb := median(times[kinds[0]]), median(times[kinds[1]]), median(times[kinds[2]])
	ratio := float64(ma) / float64(mb)
	fmt.Printf("boot median: agent image %v, dev image %v, bare qemu %v; agent/bare %.3f (target <= 1.05: %s), agent/dev %.3f\n",
		ma.Round(time.Millisecond), md.Round(time.Millisecond), mb.Round(time.Millisecond), ratio, verdict(ratio <= 1.05), float64(ma)/float64(md))

	d.Must("vm", "create", "py", "--image", "agent", "--memory", "1G", "--cpus", "1")
	defer d.Must("vm", "rm", "--force", "py")
	run := func(argv ...string) time.Duration {
		start := time.Now()
		d.Must(append([]string{"exec", "py", "--"}, argv...)...)
		return time.Since(start)
	}
	first := run("python3", "-c", "pass")
	var again, floor []time.Duration
	for i := 0; i < 5; i++ {
		again = append(again, run("python3", "-c", "pass"))
		floor = append(floor, run("true"))
	}
	fmt.Printf("first `python3 -c pass` after boot %v (cold page cache, through dm-verity and erofs); then median %v; `true` median %v\n",
		first.Round(time.Millisecond), median(again).Round(time.Millisecond), median(floor).Round(time.Millisecond))
}

// benchVerity reads a file of sizeMiB from the verified root, and the same
// file from the same erofs image without dm-verity, in one VM, with the
// page cache dropped before each read. The VM is bare QEMU with the dev
// image's root rebuilt around the file and attached twice: as the
// verified root, and again, read-only and unverified, as a second disk
// that a root command (the agent is reached directly, with no carreld and
// so no sandbox) mounts on /mnt.
func benchVerity(t *tb, dev *store.Resolved, sizeMiB int64, rounds int) {
	dir, err := os.MkdirTemp("/var/tmp", "carrel-bench-verity-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	img, err := verityBenchImage(ctx, dev, dir, sizeMiB)
	if err != nil {
		t.Fatalf("verity benchmark image: %v", err)
	}
	vm, err := startBare(ctx, img, dir, 1024, []string{"-drive", "if=none,id=raw,format=raw,readonly=on,file=" + img.SystemPath,
		"-device", "virtio-blk-pci,drive=raw,serial=carrel-bench-raw"})
	if err != nil {
		t.Fatalf("verity benchmark vm: %v", err)
	}
	defer vm.stop()
	const file = "/usr/share/carrel/bench.bin"
	if _, err := vm.root(ctx, `for b in /sys/block/*; do [ "$(cat $b/serial 2>/dev/null)" = carrel-bench-raw ] && mount -t erofs -o ro /dev/${b##*/} /mnt; done; test -f /mnt`+file); err != nil {
		t.Fatalf("mount the unverified copy: %v", err)
	}
	read := func(path string) time.Duration {
		start := time.Now()
		if _, err := vm.root(ctx, "echo 3 > /proc/sys/vm/drop_caches; cat "+path+" > /dev/null"); err != nil {
			t.Fatalf("read %s: %v", path, err)
		}
		return time.Since(start)
	}
	var verified, plain []time.Duration
	for i := 0; i < rounds; i++ {
		if i%2 == 0 {
			verified = append(verified, read(file))
			plain = append(plain, read("/mnt"+file))
		} else {
			plain = append(plain, read("/mnt"+file))
			verified = append(verified, read(file))
		}
	}
	mv, mp := median(verified), median(plain)
	tv, tp := mibps(sizeMiB<<20, mv), mibps(sizeMiB<<20, mp)
	fmt.Printf("\nverity: read %d MiB from the root, page cache dropped, %d rounds alternating: through dm-verity %.1f MiB/s, the same erofs unverified %.1f MiB/s; ratio %.3f (target >= 0.8: %s)\n",
		sizeMiB, rounds, tv, tp, tv/tp, verdict(tv/tp >= 0.8))
}

// verityBenchImage is the dev image with a root of its own: the dev root
// plus a random file of sizeMiB, uncompressed, sealed again.
func verityBenchImage(ctx context.Context, dev *store.Resolved, dir string, sizeMiB int64) (*store.Resolved, error) {
	tree := filepath.Join(dir, "tree")
	if out, err := exec.CommandContext(ctx, "fsck.erofs", "--extract="+tree, "--preserve", dev.SystemPath).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("fsck.erofs --extract: %w: %s", err, out)
	}
	f, err := os.Create(filepath.Join(tree, "usr/share/carrel/bench.bin"))
	if err != nil {
		return nil, err
	}
	_, err = io.CopyN(f, rand.Reader, sizeMiB<<20)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, err
	}
	sys, err := sysroot.Make(ctx, tree, filepath.Join(dir, "system.erofs"), filepath.Join(dir, "system.verity"), sysroot.Options{})
	if err != nil {
		return nil, err
	}
	m := *dev.Manifest
	m.System, m.SystemVerity, m.Verity = &sys.System, &sys.SystemVerity, &sys.Verity
	m.Cmdline = strings.Replace(m.Cmdline, "roothash="+dev.Manifest.Verity.RootHash, "roothash="+sys.Verity.RootHash, 1)
	if err := m.Validate(); err != nil {
		return nil, err
	}
	img := *dev
	img.Manifest, img.SystemPath, img.SystemVerityPath = &m, filepath.Join(dir, "system.erofs"), filepath.Join(dir, "system.verity")
	return &img, nil
}

// bareVM is a VM bare QEMU runs, whose agent the benchmark reaches
// directly on its virtio-serial socket.
type bareVM struct {
	cmd  *exec.Cmd
	link *agentlink.Link
}

// startBare boots img with bareBoot's devices plus extra, and waits for
// its agent.
func startBare(ctx context.Context, img *store.Resolved, dir string, memMiB int, extra []string) (*bareVM, error) {
	args, sock, err := bareArgs("q35", img, memMiB, dir)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command("qemu-system-x86_64", append(args, extra...)...)
	var console bytes.Buffer
	cmd.Stdout, cmd.Stderr = &console, &console
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	vm := &bareVM{cmd: cmd}
	vm.link = agentlink.New(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if err := vm.link.WaitReady(wctx); err != nil {
		vm.stop()
		return nil, fmt.Errorf("agent not ready: %w\n%s", err, console.String())
	}
	return vm, nil
}

// root runs a shell script as root in the VM and returns its output.
func (v *bareVM) root(ctx context.Context, script string) (string, error) {
	agent, done := v.link.Agent()
	s, err := agent.Exec(ctx, connect.NewRequest(&agentv1.ExecRequest{Argv: []string{"sh", "-c", script}, User: "root", Cwd: "/"}))
	if err != nil {
		return "", done(ctx, err)
	}
	defer s.Close()
	var out bytes.Buffer
	for {
		if !s.Receive() {
			if err := s.Err(); err != nil {
				return out.String(), done(ctx, err)
			}
			return out.String(), errors.New("exec stream ended without an exit status")
		}
		msg := s.Msg()
		out.Write(msg.GetStdout())
		out.Write(msg.GetStderr())
		if x := msg.GetExit(); x != nil {
			if x.Code != 0 || x.Signal != "" {
				return out.String(), fmt.Errorf("exit %d %s: %s", x.Code, x.Signal, out.String())
			}
			return out.String(), nil
		}
	}
}

func (v *bareVM) stop() {
	v.link.Close()
	v.cmd.Process.Kill()
	v.cmd.Wait()
}
