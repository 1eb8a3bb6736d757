// Command bench measures carrel against its baselines (make bench):
//
//   - boot to agent-ready: `carrel vm create` against bare qemu-system-x86_64
//     booting the same kernel and initrd on the same machine type to the
//     agent's ready marker on the serial port, alternating, one run;
//   - warm exec: the round trip of `carrel exec VM -- true`, p50 and p99.
//
// It prints medians and the ratio carrel/bare.
package main

import (
	"bufio"
	"flag"
	"fmt"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/image/store"
	"github.com/carrel-os/carrel/tests/harness"
)

// tb lets the harness run outside `go test`.
type tb struct{ cleanups []func() }

func (*tb) Helper()                      {}
func (*tb) Fatal(args ...any)            { log.Fatal(args...) }
func (*tb) Fatalf(f string, args ...any) { log.Fatalf(f, args...) }
func (*tb) Logf(f string, args ...any)   { log.Printf(f, args...) }
func (*tb) Skip(args ...any)             { log.Fatal(append([]any{"cannot run: "}, args...)...) }
func (t *tb) Cleanup(f func())           { t.cleanups = append(t.cleanups, f) }
func (*tb) Failed() bool                 { return false }
func (t *tb) cleanup() {
	for i := len(t.cleanups) - 1; i >= 0; i-- {
		t.cleanups[i]()
	}
}

func main() {
	rounds := flag.Int("rounds", 7, "boots of each kind, alternating")
	execs := flag.Int("execs", 100, "warm exec round trips")
	machine := flag.String("machine", "q35", "QEMU machine type for both sides: microvm or q35 (carreld's default under TCG is q35)")
	flag.Parse()
	log.SetFlags(0)

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

	fmt.Printf("boot to agent-ready, machine %s, %d rounds each, alternating (TCG unless KVM is usable)\n", *machine, *rounds)
	var ours, bare []time.Duration
	for i := 0; i < *rounds; i++ {
		name := fmt.Sprintf("bench%d", i)
		start := time.Now()
		d.Must("vm", "create", name, "--memory", "512M", "--cpus", "1")
		ours = append(ours, time.Since(start))
		d.Must("vm", "rm", "--force", name)

		b, err := bareBoot(*machine, img)
		if err != nil {
			t.Fatal(err)
		}
		bare = append(bare, b)
		fmt.Printf("  round %d: carrel %v, bare qemu %v\n", i+1, ours[i].Round(time.Millisecond), b.Round(time.Millisecond))
	}
	mo, mb := median(ours), median(bare)
	fmt.Printf("boot median: carrel %v, bare qemu %v, ratio carrel/bare %.3f (target <= 1.05)\n",
		mo.Round(time.Millisecond), mb.Round(time.Millisecond), float64(mo)/float64(mb))

	d.Must("vm", "create", "warm", "--memory", "512M", "--cpus", "1")
	d.Must("exec", "warm", "--", "true") // first call sets up the stream
	var lat []time.Duration
	for i := 0; i < *execs; i++ {
		start := time.Now()
		d.Must("exec", "warm", "--", "true")
		lat = append(lat, time.Since(start))
	}
	fmt.Printf("warm exec `carrel exec warm -- true` (CLI process included), %d runs: p50 %v, p99 %v\n",
		*execs, percentile(lat, 50).Round(10*time.Microsecond), percentile(lat, 99).Round(10*time.Microsecond))
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

func median(d []time.Duration) time.Duration { return percentile(d, 50) }

func percentile(d []time.Duration, p int) time.Duration {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	i := (len(s)*p + 99) / 100
	if i > 0 {
		i--
	}
	return s[i]
}
