package redistest

import (
	"bufio"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

const (
	// startTimeout bounds the wait for a started redis-server to answer PING.
	startTimeout = 15 * time.Second
	// stopTimeout bounds the wait for SHUTDOWN NOSAVE before the process is killed.
	stopTimeout = 5 * time.Second
	// bindAttempts is how many fresh ports Server tries when another process
	// takes the one it picked before redis-server binds it.
	bindAttempts = 5
)

// errAddrInUse marks a start that failed because a port was taken.
var errAddrInUse = errors.New("address already in use")

// Option configures a server started by [Server], [TLSServer] or [Cluster].
type Option func(*serverConfig)

type serverConfig struct {
	args    []string
	tls     *TLSFiles // serve TLS only, with these files
	cluster bool      // cluster-enabled, with a cluster bus port of its own
}

// Args adds redis-server configuration directives, written as on the
// redis-server command line: Args("--maxmemory", "10mb", "--maxmemory-policy",
// "noeviction"). They come after the package's own directives, so they
// override them.
func Args(args ...string) Option {
	return func(c *serverConfig) { c.args = append(c.args, args...) }
}

// Proc is a redis-server child process listening on 127.0.0.1, started by
// [Server], [TLSServer] or [Cluster] and stopped when the test that started it
// ends. It keeps its port and configuration across [Proc.Restart]. Its
// methods are safe for concurrent use.
type Proc struct {
	bin     string
	dir     string
	cfg     serverConfig
	port    int
	busPort int         // cluster bus port; 0 unless cfg.cluster
	tlsConf *tls.Config // nil for a plain-text server

	mu   sync.Mutex
	cmd  *exec.Cmd     // nil when not running
	done chan struct{} // closed when cmd has exited
}

// Server starts a redis-server child process on a free port of 127.0.0.1,
// with its working directory, log (redis.log) and any files in a t.TempDir(),
// no persistence (--save "" --appendonly no) and the extra configuration given
// by opts. It returns once the server answers PING, and stops it with
// t.Cleanup.
//
// The binary is [EnvRedisServerBin] or redis-server from PATH; if neither
// exists the test is skipped, or fails when CI is set. A server that does not
// start fails the test with the tail of its log.
func Server(t testing.TB, opts ...Option) *Proc {
	t.Helper()
	var cfg serverConfig
	for _, o := range opts {
		o(&cfg)
	}
	return startProc(t, cfg)
}

func startProc(t testing.TB, cfg serverConfig) *Proc {
	t.Helper()
	p := &Proc{bin: serverBin(t), dir: t.TempDir(), cfg: cfg}
	if cfg.tls != nil {
		p.tlsConf = cfg.tls.ClientConfig()
	}
	t.Cleanup(p.Stop) // runs before t.TempDir's removal: cleanups are LIFO
	var err error
	for range bindAttempts {
		ports := freePorts(t, 2)
		p.port = ports[0]
		if cfg.cluster {
			p.busPort = ports[1]
		}
		p.mu.Lock()
		err = p.startLocked()
		p.mu.Unlock()
		if !errors.Is(err, errAddrInUse) {
			break
		}
	}
	if err != nil {
		t.Fatalf("redistest: %v", err)
	}
	return p
}

// serverBin returns the redis-server binary to run, skipping or failing the
// test when there is none.
func serverBin(t testing.TB) string {
	t.Helper()
	if bin := os.Getenv(EnvRedisServerBin); bin != "" {
		if _, err := os.Stat(bin); err != nil {
			t.Fatalf("redistest: %s=%q: %v", EnvRedisServerBin, bin, err)
		}
		return bin
	}
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		missing(t, "redis-server not found in PATH and %s is not set; install redis-server or run bash scripts/test.sh", EnvRedisServerBin)
	}
	return bin
}

// missing skips the test, or fails it in CI, because a tool is not installed.
func missing(t testing.TB, format string, args ...any) {
	t.Helper()
	if inCI() {
		t.Fatalf("redistest: "+format, args...)
	}
	t.Skipf("redistest: "+format, args...)
}

// freePorts returns n distinct ports of 127.0.0.1 that were free a moment ago.
func freePorts(t testing.TB, n int) []int {
	t.Helper()
	ports := make([]int, n)
	for i := range ports {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("redistest: finding a free port: %v", err)
		}
		defer l.Close() // hold all n open so they are distinct
		ports[i] = l.Addr().(*net.TCPAddr).Port
	}
	return ports
}

// Addr returns the server's "127.0.0.1:port".
func (p *Proc) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(p.port)) }

// Port returns the TCP port the server listens on (its TLS port for a
// [TLSServer]).
func (p *Proc) Port() int { return p.port }

// URL returns a URL for redis.ParseURL naming database 0 of the server:
// "redis://127.0.0.1:port/0", or "rediss://…" for a [TLSServer] (a client built
// from it alone does not trust the test CA; use [TLSFiles.ClientConfig]).
func (p *Proc) URL() string {
	scheme := "redis"
	if p.tlsConf != nil {
		scheme = "rediss"
	}
	return scheme + "://" + p.Addr() + "/0"
}

// Client returns a go-redis client for the server (over TLS, trusting the
// test CA, for a [TLSServer]), closed when the test ends.
func (p *Proc) Client(t testing.TB) *redis.Client {
	t.Helper()
	opts := &redis.Options{Addr: p.Addr()}
	if p.tlsConf != nil {
		opts.TLSConfig = p.tlsConf.Clone()
	}
	c := redis.NewClient(opts)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// Stop shuts the server down with SHUTDOWN NOSAVE and waits for the process
// to exit, killing it if it has not exited within 5 seconds. Stopping a
// stopped server does nothing.
func (p *Proc) Stop() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.stopLocked()
}

// Kill sends SIGKILL to the server, as a crash would, and waits for the
// process to exit. Killing a stopped server does nothing.
func (p *Proc) Kill() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return
	}
	_ = p.cmd.Process.Kill()
	<-p.done
	p.cmd = nil
}

// Restart stops the server if it is running and starts it again on the same
// port with the same configuration, returning once it answers PING. Without
// persistence the restarted server is empty; a cluster node keeps its
// identity and slots (nodes.conf) and rejoins its cluster. A failed restart
// fails the test.
func (p *Proc) Restart(t testing.TB) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.stopLocked()
	var err error
	// The old process has released the port, but another may grab it in
	// between; wait a little for it rather than move to another port.
	for deadline := time.Now().Add(3 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		err = p.startLocked()
		if !errors.Is(err, errAddrInUse) || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		t.Fatalf("redistest: restart: %v", err)
	}
}

func (p *Proc) args() []string {
	args := []string{
		"--bind", "127.0.0.1",
		"--dir", p.dir,
		"--logfile", filepath.Join(p.dir, "redis.log"),
		"--daemonize", "no",
		"--save", "",
		"--appendonly", "no",
		// Replicas sync at once instead of after the default 5 s delay.
		"--repl-diskless-sync-delay", "0",
	}
	if f := p.cfg.tls; f != nil {
		args = append(args,
			"--port", "0",
			"--tls-port", strconv.Itoa(p.port),
			"--tls-cert-file", f.CertFile,
			"--tls-key-file", f.KeyFile,
			"--tls-ca-cert-file", f.CAFile,
			"--tls-auth-clients", "no",
		)
	} else {
		args = append(args, "--port", strconv.Itoa(p.port))
	}
	if p.cfg.cluster {
		args = append(args,
			"--cluster-enabled", "yes",
			"--cluster-config-file", filepath.Join(p.dir, "nodes.conf"),
			"--cluster-node-timeout", "2000",
			"--cluster-port", strconv.Itoa(p.busPort),
		)
	}
	return append(args, p.cfg.args...)
}

// startLocked starts the process and waits until it answers PING. The error
// wraps errAddrInUse when a port was taken. p.mu must be held.
func (p *Proc) startLocked() error {
	out, err := os.OpenFile(filepath.Join(p.dir, "stdout.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(p.bin, p.args()...)
	cmd.Dir = p.dir
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		out.Close()
		return fmt.Errorf("starting %s: %v", p.bin, err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		out.Close()
		close(done)
	}()
	p.cmd, p.done = cmd, done

	deadline := time.Now().Add(startTimeout)
	for {
		select {
		case <-done:
			p.cmd = nil
			logs := p.logTail()
			if strings.Contains(logs, "Address already in use") {
				return fmt.Errorf("redis-server on %s: %w", p.Addr(), errAddrInUse)
			}
			return fmt.Errorf("redis-server on %s exited during start (%s); its log ends:\n%s", p.Addr(), cmd.ProcessState, logs)
		default:
		}
		if p.ping() == nil {
			return nil
		}
		if time.Now().After(deadline) {
			p.stopLocked()
			return fmt.Errorf("redis-server on %s did not answer PING within %v; its log ends:\n%s", p.Addr(), startTimeout, p.logTail())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// stopLocked stops the process if it runs. p.mu must be held.
func (p *Proc) stopLocked() {
	if p.cmd == nil {
		return
	}
	select {
	case <-p.done: // exited by itself: the port may be another server's now
		p.cmd = nil
		return
	default:
	}
	// The server closes the connection without a reply when it shuts down;
	// any reply means it refused (NOAUTH, say), so kill it at once.
	if _, err := p.command("SHUTDOWN NOSAVE", time.Second); err == nil {
		_ = p.cmd.Process.Kill()
	}
	select {
	case <-p.done:
	case <-time.After(stopTimeout):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
	p.cmd = nil
}

// ping reports whether this process, and not another server that took the
// port while it was starting, accepts commands. A server that requires a
// password (answers NOAUTH) accepts them too.
func (p *Proc) ping() error {
	reply, err := p.command("INFO server", time.Second)
	if err != nil {
		return err
	}
	if strings.HasPrefix(reply, "-NOAUTH") {
		return nil
	}
	if want := "\nprocess_id:" + strconv.Itoa(p.cmd.Process.Pid) + "\r\n"; !strings.Contains(reply, want) {
		return fmt.Errorf("INFO server answered %.100q, want %q", reply, want)
	}
	return nil
}

// command sends one inline command and returns its reply: the line of a
// status or error reply, or the contents of a bulk string.
func (p *Proc) command(cmd string, timeout time.Duration) (string, error) {
	d := &net.Dialer{Timeout: timeout}
	var (
		conn net.Conn
		err  error
	)
	if p.tlsConf != nil {
		conn, err = tls.DialWithDialer(d, "tcp", p.Addr(), p.tlsConf)
	} else {
		conn, err = d.Dial("tcp", p.Addr())
	}
	if err != nil {
		return "", err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(timeout))
	if _, err := conn.Write([]byte(cmd + "\r\n")); err != nil {
		return "", err
	}
	r := bufio.NewReader(conn)
	line, err := r.ReadString('\n')
	if err != nil {
		return "", err
	}
	line = strings.TrimRight(line, "\r\n")
	if !strings.HasPrefix(line, "$") {
		return line, nil
	}
	n, err := strconv.Atoi(line[1:])
	if err != nil || n < 0 {
		return "", fmt.Errorf("bad bulk reply %q", line)
	}
	body := make([]byte, n)
	_, err = io.ReadFull(r, body)
	return string(body), err
}

// logTail returns the end of the server's log and of its standard output.
func (p *Proc) logTail() string {
	var b strings.Builder
	for _, name := range []string{"stdout.log", "redis.log"} {
		data, err := os.ReadFile(filepath.Join(p.dir, name))
		if err != nil || len(data) == 0 {
			continue
		}
		if len(data) > 2000 {
			data = data[len(data)-2000:]
		}
		fmt.Fprintf(&b, "--- %s ---\n%s", name, data)
	}
	return b.String()
}
