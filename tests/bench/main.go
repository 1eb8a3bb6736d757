// Command bench measures carrel against its baselines (make bench):
//
//   - boot to agent-ready (-boot): `carrel vm create` against bare
//     qemu-system-x86_64 booting the same kernel and initrd on the same
//     machine type to the agent's ready marker on the serial port,
//     alternating, one run;
//   - warm exec (-warm-exec): the round trip of `carrel exec VM -- true`,
//     CLI process included, p50 and p99;
//   - against qemu-guest-agent (-qga-exec, -qga-files), in one VM booted by
//     carreld from the qemu-guest-agent variant of the dev image, with
//     qemu-ga and a bare port hot-added on carrel's own virtio-serial
//     controller (see qga.go): the round trip of `true` (carrel's Go
//     client against guest-exec plus guest-exec-status polling), and file
//     write and read throughput (Upload/Download against
//     guest-file-write/-read, and against the raw port);
//   - policy decisions (-policy): the default bundle's prepared queries
//     against compiling the bundle on every call (see policy.go); needs
//     no VM;
//   - the audit log (-audit): durable append throughput and latency with
//     group commit against an fdatasync per record, and verification
//     speed (see audit.go); needs no VM.
//
// Every section is on by default; each prints medians and ratios.
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/image/store"
	"github.com/carrel-os/carrel/supervisor/client"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
	"github.com/carrel-os/carrel/tests/harness"
	"github.com/carrel-os/carrel/tests/qga"
)

// tb lets the harness run outside `go test`. Fatal runs the cleanups (which
// stop carreld and kill its VMs) before exiting.
type tb struct {
	cleanups []func()
	failed   bool
}

func (*tb) Helper()                     {}
func (t *tb) Fatal(args ...any)         { t.fail(fmt.Sprint(args...)) }
func (t *tb) Fatalf(f string, a ...any) { t.fail(fmt.Sprintf(f, a...)) }
func (*tb) Logf(f string, args ...any)  { log.Printf(f, args...) }
func (t *tb) Skip(args ...any)          { t.fail("cannot run: " + fmt.Sprint(args...)) }
func (t *tb) Cleanup(f func())          { t.cleanups = append(t.cleanups, f) }
func (t *tb) Failed() bool              { return t.failed }
func (t *tb) fail(msg string) {
	log.Print(msg)
	t.failed = true
	t.cleanup()
	os.Exit(1)
}
func (t *tb) cleanup() {
	for len(t.cleanups) > 0 { // a cleanup that fails must not rerun the rest
		f := t.cleanups[len(t.cleanups)-1]
		t.cleanups = t.cleanups[:len(t.cleanups)-1]
		f()
	}
}

func main() {
	doBoot := flag.Bool("boot", true, "boot to agent-ready: carrel against bare QEMU")
	doWarm := flag.Bool("warm-exec", true, "warm `carrel exec -- true` through the CLI")
	doQGAExec := flag.Bool("qga-exec", true, "exec round trip: carrel against qemu-guest-agent")
	doQGAFiles := flag.Bool("qga-files", true, "file throughput: carrel against qemu-guest-agent and the raw port")
	rounds := flag.Int("rounds", 7, "boots of each kind, alternating")
	execs := flag.Int("execs", 100, "warm exec round trips (CLI), and of each kind against qemu-ga")
	machine := flag.String("machine", "q35", "QEMU machine type for every VM: microvm or q35 (carreld's default under TCG is q35)")
	sizeMiB := flag.Int64("size", 256, "file size for the throughput comparison, MiB (whole MiB)")
	fileRounds := flag.Int("file-rounds", 3, "rounds of the throughput comparison (each moves -size both ways on every side)")
	chunkKiB := flag.Int("qga-chunk", 4096, "KiB per guest-file-read/-write (qemu-ga caps a read at 48 MiB)")
	qgaMemory := flag.String("qga-memory", "1G", "memory of the comparison VM; its /tmp (tmpfs, half of memory) must hold -size")
	doPolicy := flag.Bool("policy", true, "policy decision latency: prepared queries against compiling per call")
	doAudit := flag.Bool("audit", true, "audit log: durable append throughput and latency against fsync per record, verification speed")
	flag.Parse()
	log.SetFlags(0)
	switch {
	case *rounds < 1 || *execs < 1 || *fileRounds < 1:
		log.Fatal("-rounds, -execs and -file-rounds must be at least 1")
	case *sizeMiB < 1:
		log.Fatal("-size must be at least 1 (MiB)")
	case *chunkKiB < 1 || *chunkKiB<<10 > qga.MaxReadCount:
		log.Fatalf("-qga-chunk must be 1..%d (KiB)", qga.MaxReadCount>>10)
	}

	if *doPolicy {
		if err := benchPolicy(); err != nil {
			log.Fatalf("policy benchmark: %v", err)
		}
	}
	if *doAudit {
		if err := benchAudit(); err != nil {
			log.Fatalf("audit benchmark: %v", err)
		}
	}
	if !*doBoot && !*doWarm && !*doQGAExec && !*doQGAFiles {
		return // no VM needed
	}

	t := &tb{}
	defer t.cleanup()
	d := harness.New(t, "--machine", *machine)
	d.Start()
	d.BuildImage()
	st, err := store.Open(filepath.Join(d.State, "images"))
	if err != nil {
		t.Fatal(err)
	}
	img, err := st.Resolve("dev")
	if err != nil {
		t.Fatal(err)
	}
	fmt.Printf("carrel benchmarks: machine %s, 1 vCPU, accelerator %s, %d host CPUs\n", *machine, accelOf(d), runtime.NumCPU())

	if *doBoot {
		benchBoot(t, d, img, *machine, *rounds)
	}
	if *doWarm {
		benchWarmExec(d, *execs)
	}
	if *doQGAExec || *doQGAFiles {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Hour)
		defer cancel()
		c := client.New(d.Socket)
		b, err := setupQGA(ctx, d, c, *qgaMemory)
		if b != nil {
			t.Cleanup(b.close)
		}
		if err != nil {
			t.Fatalf("qemu-ga comparison: %v", err)
		}
		fmt.Printf("\nagainst qemu-guest-agent %s: one VM from the variant image (%s, 1 vCPU), carrel and qemu-ga on ports of the same virtio-serial controller\n",
			b.gaVer, *qgaMemory)
		if *doQGAExec {
			if err := b.benchExec(ctx, *execs); err != nil {
				t.Fatalf("exec comparison: %v", err)
			}
		}
		if *doQGAFiles {
			if err := b.benchFiles(ctx, *sizeMiB<<20, *fileRounds, *chunkKiB<<10); err != nil {
				t.Fatalf("file comparison: %v", err)
			}
		}
		d.Must("vm", "rm", "--force", b.vm)
	}
}

// accelOf reports the accelerator carreld's VMs get.
func accelOf(d *harness.Daemon) string {
	resp, err := client.New(d.Socket).System.GetInfo(context.Background(), connect.NewRequest(&apiv1.GetInfoRequest{}))
	if err != nil {
		return "unknown accelerator"
	}
	return resp.Msg.Accelerator
}

func benchBoot(t *tb, d *harness.Daemon, img *store.Resolved, machine string, rounds int) {
	fmt.Printf("\nboot to agent-ready, machine %s, %d rounds each, alternating:\n", machine, rounds)
	var ours, bare []time.Duration
	for i := 0; i < rounds; i++ {
		name := fmt.Sprintf("bench%d", i)
		start := time.Now()
		d.Must("vm", "create", name, "--memory", "512M", "--cpus", "1")
		ours = append(ours, time.Since(start))
		d.Must("vm", "rm", "--force", name)

		b, err := bareBoot(machine, img)
		if err != nil {
			t.Fatal(err)
		}
		bare = append(bare, b)
		fmt.Printf("  round %d: carrel %v, bare qemu %v\n", i+1, ours[i].Round(time.Millisecond), b.Round(time.Millisecond))
	}
	mo, mb := median(ours), median(bare)
	fmt.Printf("boot median: carrel %v, bare qemu %v, ratio carrel/bare %.3f (target <= 1.05)\n",
		mo.Round(time.Millisecond), mb.Round(time.Millisecond), float64(mo)/float64(mb))
}

func benchWarmExec(d *harness.Daemon, execs int) {
	d.Must("vm", "create", "warm", "--memory", "512M", "--cpus", "1")
	d.Must("exec", "warm", "--", "true") // first call sets up the stream
	var lat []time.Duration
	for i := 0; i < execs; i++ {
		start := time.Now()
		d.Must("exec", "warm", "--", "true")
		lat = append(lat, time.Since(start))
	}
	fmt.Printf("\nwarm exec `carrel exec warm -- true` (CLI process included), %d runs: p50 %v, p99 %v\n",
		execs, percentile(lat, 50).Round(10*time.Microsecond), percentile(lat, 99).Round(10*time.Microsecond))
	d.Must("vm", "rm", "--force", "warm")
}

// bareBoot boots the image with plain QEMU and the same devices carreld
// gives a VM, and times the start of QEMU to the agent's ready marker on
// the serial console.
func bareBoot(machine string, img *store.Resolved) (time.Duration, error) {
	dir, err := os.MkdirTemp("/tmp", "bare-")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(dir)
	mopt, serialDev := "microvm,accel=tcg", "virtio-serial-device"
	cmdline := img.Manifest.Cmdline + " reboot=t"
	if machine == "q35" {
		mopt, serialDev, cmdline = "q35,accel=tcg", "virtio-serial-pci", img.Manifest.Cmdline
	}
	args := []string{
		"-machine", mopt, "-cpu", "max", "-m", "512M", "-smp", "1",
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-kernel", img.KernelPath, "-initrd", img.InitrdPath, "-append", cmdline,
		"-serial", "stdio",
		"-device", serialDev + ",id=vser0",
		"-chardev", "socket,id=agent,path=" + filepath.Join(dir, "agent.sock") + ",server=on,wait=off",
		"-device", "virtserialport,bus=vser0.0,chardev=agent,name=" + protocol.SerialPortName,
	}
	cmd := exec.Command("qemu-system-x86_64", args...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		return 0, err
	}
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if strings.Contains(sc.Text(), protocol.ReadyMarker) {
			return time.Since(start), nil
		}
	}
	return 0, fmt.Errorf("bare qemu exited before the ready marker: %v", sc.Err())
}
