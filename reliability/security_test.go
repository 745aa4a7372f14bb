package reliability

import (
	"context"
	"crypto/rand"
	"crypto/sha1"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// ---------------------------------------------------------------- TLS

// TestTLS runs the library over TLS against a redis-server that serves
// only TLS, with a throwaway CA: a rediss:// URL (redis.ParseURL) with the
// CA in TLSConfig.RootCAs runs every operation; a client trusting another
// CA fails at once with ErrRedis wrapping x509.UnknownAuthorityError; a
// plain-text client fails with ErrRedis. cmd/worker and cmd/enqueue have no
// CA flag: they trust the CA through SSL_CERT_FILE (Go's standard override
// of the system roots), which the test checks, and fail clearly without it.
func TestTLS(t *testing.T) {
	t.Parallel() // long; overlaps TestAsynqThroughRedisOutage, which mostly waits
	srv, files := redistest.TLSServer(t)
	pem, err := os.ReadFile(files.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		t.Fatal("no certificate in the CA file")
	}
	tlsClient := func(t *testing.T, pool *x509.CertPool) *redis.Client {
		opts, err := redis.ParseURL(srv.URL())
		if err != nil {
			t.Fatal(err)
		}
		if opts.TLSConfig == nil {
			t.Fatalf("redis.ParseURL(%q) gave no TLS config", srv.URL())
		}
		opts.TLSConfig.RootCAs = pool
		opts.DialerRetries, opts.MaxRetries = 1, 1
		c := redis.NewClient(opts)
		t.Cleanup(func() { _ = c.Close() })
		return c
	}

	t.Run("library", func(t *testing.T) {
		c := tlsClient(t, roots)
		prefix := redistest.Prefix(t)
		exercise(t, c, prefix)
		assertKeyHygiene(t, c, prefix)
	})
	t.Run("wrong CA", func(t *testing.T) {
		lim, err := throttle.New(tlsClient(t, redistest.OtherCA(t)), throttle.Options{}, exerciseRules[4])
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		_, err = lim.Allow(context.Background(), "s")
		var ua x509.UnknownAuthorityError
		if !errors.Is(err, throttle.ErrRedis) || !errors.As(err, &ua) {
			t.Fatalf("Allow through a client that trusts another CA = %v; want ErrRedis wrapping x509.UnknownAuthorityError", err)
		}
		t.Logf("wrong CA: %v, after %v", err, time.Since(start).Round(time.Millisecond))
	})
	t.Run("plain text to a TLS port", func(t *testing.T) {
		c := redis.NewClient(recommendedOptions(srv.Addr()))
		t.Cleanup(func() { _ = c.Close() })
		lim, err := throttle.New(c, throttle.Options{}, exerciseRules[4])
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		_, err = lim.Allow(context.Background(), "s")
		if !errors.Is(err, throttle.ErrRedis) {
			t.Fatalf("Allow in plain text to a TLS port = %v; want ErrRedis", err)
		}
		t.Logf("plain text to a TLS port: %v, after %v", err, time.Since(start).Round(time.Millisecond))
	})
	t.Run("cmd/worker", func(t *testing.T) {
		bin := buildBinary(t, "cmd/worker")
		// Without the CA: a clear failure, and no start.
		out, err := runFor(t, 20*time.Second, nil, bin, "--redis", srv.URL())
		if err == nil || !strings.Contains(out, "certificate signed by unknown authority") {
			t.Errorf("worker with an untrusted CA: %v; want exit 1 naming the unknown authority:\n%s", err, out)
		}
		// With SSL_CERT_FILE: it connects and processes.
		w := startProcess(t, []string{"SSL_CERT_FILE=" + files.CAFile}, bin, "--redis", srv.URL())
		w.waitFor(t, "worker: processing", 30*time.Second)
		w.stop(t, syscall.SIGTERM, 30*time.Second)
	})
	t.Run("cmd/enqueue", func(t *testing.T) {
		bin := buildBinary(t, "cmd/enqueue")
		args := []string{"batch", "--type", "tls:probe", "--count", "3", "--queue", "tls-probe", "--redis", srv.URL()}
		if out, err := runFor(t, 20*time.Second, nil, bin, args...); err == nil || !strings.Contains(out, "certificate signed by unknown authority") {
			t.Errorf("enqueue with an untrusted CA: %v; want a failure naming the unknown authority:\n%s", err, out)
		}
		if out, err := runFor(t, 20*time.Second, []string{"SSL_CERT_FILE=" + files.CAFile}, bin, args...); err != nil {
			t.Fatalf("enqueue with SSL_CERT_FILE: %v\n%s", err, out)
		}
		c := tlsClient(t, roots)
		if n, err := c.LLen(context.Background(), "asynq:{tls-probe}:pending").Result(); err != nil || n != 3 {
			t.Errorf("tasks pending after enqueue over TLS: %d, %v; want 3", n, err)
		}
	})
}

// ---------------------------------------------------------------- ACL

// aclCommands are the commands a Redis user needs to run jobthrottle's
// library, found by TestACL (every one is needed: without any of them some
// operation fails). EVALSHA and SCRIPT LOAD run the scripts (the limiter
// loads each script once, then calls it by hash); the others are the
// commands the scripts call, which Redis 7 checks against the user too.
// RELIABILITY.md gives the full ACL SETUSER line.
var aclCommands = []string{
	"evalsha", "script|load",
	"time", "get", "set", "del", "exists", "pexpire", "pttl",
	"hget", "hmget", "hset", "hgetall", "hdel", "hexists", "hincrby",
	"zadd", "zrem", "zcard", "zrange", "zrevrange", "zscore", "zrangebyscore", "zremrangebyscore",
}

// setUser creates (or resets) the ACL user name with password pw, keys
// ~<keys>, no channels and exactly the commands cmds.
func setUser(t *testing.T, admin *redis.Client, name, pw, keys string, cmds []string) {
	t.Helper()
	args := []any{"ACL", "SETUSER", name, "reset", "on", ">" + pw, "~" + keys, "resetchannels", "-@all"}
	for _, c := range cmds {
		args = append(args, "+"+c)
	}
	if err := admin.Do(context.Background(), args...).Err(); err != nil {
		t.Fatalf("ACL SETUSER: %v", err)
	}
}

// TestACL checks the minimal Redis ACL for the library: a user limited to
// keys ~jt:* and aclCommands runs every operation (exercise); for each of
// those commands, a user without it fails somewhere with a permission
// error matching ErrRedis (so the list is minimal for what exercise
// covers); a user without commands gets NOPERM at once; a prefix outside
// the user's key pattern gets NOPERM for the keys.
func TestACL(t *testing.T) {
	srv := redistest.Server(t)
	admin := srv.Client(t)
	userClient := func(t *testing.T, name string) *redis.Client {
		c := redis.NewClient(&redis.Options{Addr: srv.Addr(), Username: name, Password: "pw-" + name})
		t.Cleanup(func() { _ = c.Close() })
		return c
	}
	prefix := func(t *testing.T) string { return "jt:" + strings.TrimPrefix(redistest.Prefix(t), "jt-test:") }

	t.Run("minimal set works", func(t *testing.T) {
		setUser(t, admin, "jt", "pw-jt", "jt:*", aclCommands)
		c := userClient(t, "jt")
		exercise(t, c, prefix(t))
		t.Logf("ACL SETUSER jt on >… ~jt:* resetchannels -@all +%s", strings.Join(aclCommands, " +"))
	})
	t.Run("each command is needed", func(t *testing.T) {
		for _, cmd := range aclCommands {
			t.Run(cmd, func(t *testing.T) {
				t.Parallel()
				name := "jt-no-" + strings.ReplaceAll(cmd, "|", "-")
				admin, c := admin, (*redis.Client)(nil)
				if cmd == "script|load" {
					// The script cache is the server's, not the user's: on a
					// server where another user loaded the scripts, EVALSHA
					// alone works, until a restart empties the cache.
					own := redistest.Server(t)
					admin = own.Client(t)
					c = redis.NewClient(&redis.Options{Addr: own.Addr(), Username: name, Password: "pw-" + name})
					t.Cleanup(func() { _ = c.Close() })
				}
				setUser(t, admin, name, "pw-"+name, "jt:*", slices.DeleteFunc(slices.Clone(aclCommands), func(c string) bool { return c == cmd }))
				if c == nil {
					c = userClient(t, name)
				}
				err := exerciseErr(c, prefix(t))
				switch {
				case err == nil:
					t.Errorf("every operation ran without %q: it is not needed (or exercise misses the path that needs it)", cmd)
				case !errors.Is(err, throttle.ErrRedis) && !errors.Is(err, errReported):
					t.Errorf("without %q: %v; want an error matching ErrRedis (or reported to OnRedisError)", cmd, err)
				case !isPermissionError(err):
					t.Errorf("without %q: %v; want a permission error", cmd, err)
				}
			})
		}
	})
	t.Run("no commands", func(t *testing.T) {
		setUser(t, admin, "jt-none", "pw-jt-none", "jt:*", nil)
		lim, err := throttle.New(userClient(t, "jt-none"), throttle.Options{Prefix: prefix(t)}, exerciseRules[4])
		if err != nil {
			t.Fatal(err)
		}
		_, err = lim.Allow(context.Background(), "s")
		if !errors.Is(err, throttle.ErrRedis) || !strings.Contains(err.Error(), "NOPERM") {
			t.Errorf("Allow by a user without commands = %v; want ErrRedis wrapping NOPERM", err)
		}
		t.Logf("user without commands: %v", err)
	})
	t.Run("prefix outside the key pattern", func(t *testing.T) {
		setUser(t, admin, "jt-keys", "pw-jt-keys", "jt:*", aclCommands)
		lim, err := throttle.New(userClient(t, "jt-keys"), throttle.Options{Prefix: "other:"}, exerciseRules[4])
		if err != nil {
			t.Fatal(err)
		}
		_, err = lim.Allow(context.Background(), "s")
		if !errors.Is(err, throttle.ErrRedis) || !strings.Contains(err.Error(), "NOPERM") {
			t.Errorf("Allow under a prefix outside ~jt:* = %v; want ErrRedis wrapping NOPERM", err)
		}
		t.Logf("prefix outside the key pattern: %v", err)
	})
}

// isPermissionError reports whether err is Redis refusing a command or key
// to the user: NOPERM for a command the client sends, or the error a script
// gets for a command the user may not run.
func isPermissionError(err error) bool {
	s := err.Error()
	return strings.Contains(s, "NOPERM") || strings.Contains(s, "can't run this command")
}

// ---------------------------------------------------------------- secrets

// secretPassword returns a password no test output could contain by chance.
func secretPassword() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return "s3cr3t-" + hex.EncodeToString(b[:])
}

// secretForms are the ways a password can appear in text.
func secretForms(pw string) []string {
	return []string{pw, url.QueryEscape(pw), url.PathEscape(pw)}
}

// refusedAddr returns a loopback address that refuses connections for the
// rest of the test: its port is bound by a socket that never listens, so no
// server another test starts meanwhile can take it. (A port that was merely
// free a moment ago can be: a no-password redis-server that took it lets a
// client with a password in, and the worker then runs instead of failing.)
func refusedAddr(t *testing.T) string {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("127.0.0.1:%d", sa.(*syscall.SockaddrInet4).Port)
}

// freeAddr returns a loopback address nothing listened on a moment ago, for
// a server the test starts itself.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	return addr
}

// TestSecretsStayOut runs the library and both binaries with a Redis URL
// holding a password, against a server that wants another password and
// against no server at all, and checks that the password appears in no
// error, no log line (the limiter's, go-redis's own, the binaries' output),
// no OnRedisError error and no metric.
func TestSecretsStayOut(t *testing.T) {
	t.Parallel() // long; overlaps TestAsynqThroughRedisOutage, which mostly waits
	pw := secretPassword()
	guarded := redistest.Server(t, redistest.Args("--requirepass", "the-right-one"))
	targets := map[string]string{
		"wrong password": "redis://default:" + pw + "@" + guarded.Addr() + "/0",
		"no server":      "redis://:" + pw + "@" + refusedAddr(t) + "/0",
		"password param": "redis://" + refusedAddr(t) + "/0?password=" + pw,
	}
	check := func(t *testing.T, what, text string) {
		t.Helper()
		for _, f := range secretForms(pw) {
			if strings.Contains(text, f) {
				t.Errorf("the password appears in %s:\n%s", what, text)
				return
			}
		}
	}

	t.Run("library", func(t *testing.T) {
		for name, raw := range targets {
			t.Run(name, func(t *testing.T) {
				opts, err := redis.ParseURL(raw)
				if err != nil {
					// go-redis takes no password= parameter; its error must
					// not repeat it either.
					check(t, "redis.ParseURL's error", err.Error())
					t.Logf("redis.ParseURL refuses it (%v): no client to test further", err)
					return
				}
				opts.DialerRetries, opts.MaxRetries = 1, 1
				rdb := redis.NewClient(opts)
				t.Cleanup(func() { _ = rdb.Close() })
				var texts []string
				var mu sync.Mutex
				for _, failOpen := range []bool{false, true} {
					logs := newLogRecorder()
					lim, err := throttle.New(rdb, throttle.Options{
						Prefix: "secrets:", FailOpen: failOpen, Logger: slogLogger(logs),
						OnRedisError: func(err error, _ bool) { mu.Lock(); texts = append(texts, err.Error()); mu.Unlock() },
					}, exerciseRules[4], exerciseRules[0])
					if err != nil {
						t.Fatal(err)
					}
					bucket, err := throttle.New(rdb, throttle.Options{Prefix: "secrets:", FailOpen: failOpen, Logger: slogLogger(logs)}, exerciseRules[4])
					if err != nil {
						t.Fatal(err)
					}
					ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
					_, err1 := lim.Allow(ctx, "s")
					err2 := lim.Wait(ctx, "s")
					_, err3 := bucket.ReserveN(ctx, "s", 1)
					_, err4 := bucket.PauseFor(ctx, "s", time.Second)
					_, err5 := bucket.PauseFor(ctx, "s", 0)
					_, err6 := bucket.PrepayN(ctx, "s", 1, 0)
					_, err7 := bucket.Admit(ctx, throttle.AdmitRequest{Subject: "s", N: 1, Caller: throttle.Caller{Receipt: "0123"}, Wait: -1})
					cancel()
					errs := []error{err1, err2, err3, err4, err5, err6, err7}
					if !failOpen && !errors.Is(err1, throttle.ErrRedis) {
						t.Errorf("Allow = %v; want ErrRedis", err1)
					}
					for _, e := range errs {
						if e != nil {
							texts = append(texts, e.Error(), fmt.Sprintf("%+v", e), fmt.Sprintf("%#v", e))
						}
					}
					texts = append(texts, logs.Lines()...)
				}
				texts = append(texts, redisLog.all()...)
				check(t, "the library's errors, logs and OnRedisError errors, and go-redis's log", strings.Join(texts, "\n"))
				t.Logf("%d texts checked; e.g. %s", len(texts), texts[0])
			})
		}
	})

	t.Run("cmd/worker", func(t *testing.T) {
		bin := buildBinary(t, "cmd/worker")
		for name, raw := range targets {
			for _, via := range []string{"flag", "env"} {
				args, env := []string{"--redis", raw}, []string(nil)
				if via == "env" {
					args, env = nil, []string{"REDIS_URL=" + raw}
				}
				out, err := runFor(t, 30*time.Second, env, bin, args...)
				if err == nil {
					t.Errorf("%s via %s: worker exited 0; want a failure", name, via)
				}
				check(t, "cmd/worker's output ("+name+", URL via "+via+")", out)
			}
		}
		// -help with the URL in the environment.
		out, _ := runFor(t, 10*time.Second, []string{"REDIS_URL=" + targets["no server"]}, bin, "-help")
		check(t, "cmd/worker -help", out)
		// Metrics of a worker whose URL holds its (right) password.
		url := "redis://default:" + pw + "@" + redistest.Server(t, redistest.Args("--requirepass", pw)).Addr() + "/0"
		metricsAddr := freeAddr(t)
		w := startProcess(t, nil, bin, "--redis", url, "--metrics-addr", metricsAddr)
		w.waitFor(t, "worker: processing", 30*time.Second)
		resp, err := http.Get("http://" + metricsAddr + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		check(t, "cmd/worker's /metrics", string(body))
		w.stop(t, syscall.SIGTERM, 30*time.Second)
		check(t, "cmd/worker's output while running", w.out.String())
	})

	t.Run("cmd/enqueue", func(t *testing.T) {
		bin := buildBinary(t, "cmd/enqueue")
		for name, raw := range targets {
			for _, via := range []string{"flag", "env"} {
				args := []string{"batch", "--type", "secret:probe", "--count", "1"}
				var env []string
				if via == "flag" {
					args = append(args, "--redis", raw)
				} else {
					env = []string{"REDIS_URL=" + raw}
				}
				out, err := runFor(t, 30*time.Second, env, bin, args...)
				if err == nil {
					t.Errorf("%s via %s: enqueue exited 0; want a failure", name, via)
				}
				check(t, "cmd/enqueue's output ("+name+", URL via "+via+")", out)
			}
		}
	})
}

// runFor runs bin with args and env added to this environment, for at
// most d, and returns its combined output and error.
func runFor(t *testing.T, d time.Duration, env []string, bin string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		t.Errorf("%s %v did not finish within %v", filepath.Base(bin), args, d)
	}
	return string(out), err
}

// process is a binary started by startProcess.
type process struct {
	cmd  *exec.Cmd
	out  *syncBuffer
	done chan error
}

// startProcess starts bin with args and env added to this environment,
// killing it when the test ends if it still runs.
func startProcess(t *testing.T, env []string, bin string, args ...string) *process {
	t.Helper()
	p := &process{cmd: exec.Command(bin, args...), out: &syncBuffer{}, done: make(chan error, 1)}
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		<-p.done
	})
	return p
}

// waitFor waits until the process's output contains s.
func (p *process) waitFor(t *testing.T, s string, d time.Duration) {
	t.Helper()
	for deadline := time.Now().Add(d); !strings.Contains(p.out.String(), s); time.Sleep(20 * time.Millisecond) {
		select {
		case err := <-p.done:
			p.done <- err
			t.Fatalf("%s exited (%v) before printing %q:\n%s", filepath.Base(p.cmd.Path), err, s, p.out)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not print %q within %v:\n%s", filepath.Base(p.cmd.Path), s, d, p.out)
		}
	}
}

// stop sends sig and waits up to d for the process to exit 0.
func (p *process) stop(t *testing.T, sig os.Signal, d time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	_ = p.cmd.Process.Signal(sig)
	select {
	case err := <-p.done:
		p.done <- err
		if err != nil {
			t.Errorf("%s exited with %v after %v:\n%s", filepath.Base(p.cmd.Path), err, sig, p.out)
		}
	case <-time.After(d):
		t.Fatalf("%s did not exit within %v of %v:\n%s", filepath.Base(p.cmd.Path), d, sig, p.out)
	}
	return time.Since(start)
}

// ---------------------------------------------------------------- scripts

// luaFiles returns every throttle/lua/*.lua file's content by name.
func luaFiles(t *testing.T) map[string]string {
	t.Helper()
	paths, err := filepath.Glob("../throttle/lua/*.lua")
	if err != nil || len(paths) == 0 {
		t.Fatalf("no Lua files under ../throttle/lua: %v", err)
	}
	files := map[string]string{}
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		files[filepath.Base(p)] = string(b)
	}
	return files
}

// splitScript reports whether text is a concatenation of the files, each
// followed by a newline (how throttle's buildScript joins them), and which.
func splitScript(text string, files map[string]string) ([]string, bool) {
	var parts []string
	for text != "" {
		found := false
		for name, src := range files {
			if strings.HasPrefix(text, src+"\n") {
				parts = append(parts, name)
				text = text[len(src)+1:]
				found = true
				break
			}
		}
		if !found {
			return parts, false
		}
	}
	return parts, len(parts) > 0
}

// TestScriptsAreConstant checks that user data reaches Redis only as KEYS
// and ARGV, never as script text.
//
// Statically: the Lua files never compile code at run time (load,
// loadstring, dofile, loadfile, setfenv); in the module's Go code (not
// tests, not bench/), redis.NewScript is called only in throttle's
// buildScript, which only concatenates embedded files read with
// luaFiles.ReadFile, and nothing but throttle/run.go (which runs those
// scripts) sends EVAL/EVALSHA/SCRIPT LOAD.
//
// Dynamically: with rule names and subjects that look like Lua ("'); redis.
// call('FLUSHALL') --" and friends) every operation runs on a real Redis,
// and every script text the client sends (SCRIPT LOAD, EVAL) is exactly a
// concatenation of the Lua files, and every EVALSHA names one of them.
func TestScriptsAreConstant(t *testing.T) {
	files := luaFiles(t)
	t.Run("lua", func(t *testing.T) {
		dyn := regexp.MustCompile(`\b(loadstring|load|dofile|loadfile|setfenv|getfenv)\s*\(`)
		for name, src := range files {
			if m := dyn.FindString(src); m != "" {
				t.Errorf("%s calls %s: code compiled at run time could come from data", name, m)
			}
		}
	})
	t.Run("go", func(t *testing.T) {
		fset := token.NewFileSet()
		var goFiles []string
		for _, dir := range []string{"throttle", "worker", "enqueue", "cmd/worker", "cmd/enqueue", "internal/devredis"} {
			m, _ := filepath.Glob(filepath.Join("..", dir, "*.go"))
			goFiles = append(goFiles, m...)
		}
		newScripts := 0
		for _, path := range goFiles {
			if strings.HasSuffix(path, "_test.go") {
				continue
			}
			f, err := parser.ParseFile(fset, path, nil, 0)
			if err != nil {
				t.Fatal(err)
			}
			var fn string
			ast.Inspect(f, func(n ast.Node) bool {
				if d, ok := n.(*ast.FuncDecl); ok {
					fn = d.Name.Name
				}
				call, ok := n.(*ast.CallExpr)
				if !ok {
					return true
				}
				sel, ok := call.Fun.(*ast.SelectorExpr)
				if !ok {
					return true
				}
				switch sel.Sel.Name {
				case "NewScript":
					newScripts++
					if filepath.Base(path) != "scripts.go" || fn != "buildScript" {
						t.Errorf("%s: redis.NewScript in %s; scripts must be built only by throttle's buildScript from the embedded files", fset.Position(call.Pos()), fn)
					}
				case "Eval", "EvalSha", "EvalRO", "EvalShaRO", "ScriptLoad", "FCall", "FunctionLoad":
					// throttle/run.go runs the *redis.Script values that
					// buildScript made; nothing else may send script text.
					if path != filepath.Join("..", "throttle", "run.go") {
						t.Errorf("%s: %s outside throttle/run.go", fset.Position(call.Pos()), sel.Sel.Name)
					}
				}
				return true
			})
		}
		if newScripts != 1 {
			t.Errorf("%d redis.NewScript calls; want exactly 1, in buildScript", newScripts)
		}
		// buildScript writes nothing but the files and newlines.
		src, err := os.ReadFile("../throttle/scripts.go")
		if err != nil {
			t.Fatal(err)
		}
		body := string(src)
		i := strings.Index(body, "func buildScript(")
		if i < 0 {
			t.Fatal("no buildScript in throttle/scripts.go")
		}
		body = body[i:]
		body = body[:strings.Index(body, "\n}\n")]
		for _, line := range strings.Split(body, "\n") {
			if strings.Contains(line, ".Write") && !strings.Contains(line, "b.Write(src)") && !strings.Contains(line, "b.WriteByte('\\n')") {
				t.Errorf("buildScript writes something other than a file or a newline: %s", strings.TrimSpace(line))
			}
		}
		if !strings.Contains(body, "luaFiles.ReadFile(") {
			t.Errorf("buildScript does not read the embedded files")
		}
	})
	t.Run("on the wire", func(t *testing.T) {
		srv := redistest.Server(t)
		rdb := srv.Client(t)
		loads := &loadRecorder{}
		rdb.AddHook(loads)
		ctx := context.Background()
		hostile := []string{
			"'); redis.call('FLUSHALL') --", "]] redis.call('FLUSHALL') --[[", "\" .. redis.call('FLUSHALL') .. \"",
			"%s%d%q", "\x00end", "return 1",
		}
		if err := rdb.Set(ctx, "canary", "alive", time.Minute).Err(); err != nil {
			t.Fatal(err)
		}
		for _, h := range hostile {
			lim, err := throttle.New(rdb, throttle.Options{Prefix: "jt:" + strings.NewReplacer("{", "", "}", "").Replace(h) + ":"},
				throttle.Rule{Name: h, Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10)},
				throttle.Rule{Name: h + "2", Algorithm: throttle.SlidingWindow, Limit: throttle.PerSecond(10)})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := lim.Allow(ctx, h); err != nil {
				t.Fatalf("Allow(%q): %v", h, err)
			}
		}
		exercise(t, rdb, "jt:wire:")
		if v, err := rdb.Get(ctx, "canary").Result(); err != nil || v != "alive" {
			t.Fatalf("canary key: %q, %v", v, err)
		}

		shas := map[string][]string{}
		for _, text := range loads.texts() {
			parts, ok := splitScript(text, files)
			if !ok {
				t.Errorf("a script sent to Redis is not a concatenation of throttle/lua files (parsed %v):\n%.300s", parts, text)
				continue
			}
			sum := sha1.Sum([]byte(text))
			shas[hex.EncodeToString(sum[:])] = parts
		}
		evalshas := loads.evalshas()
		for _, sha := range evalshas {
			if _, ok := shas[sha]; !ok {
				t.Errorf("EVALSHA %s names no script the client loaded from the Lua files", sha)
			}
		}
		var kinds []string
		for _, parts := range shas {
			kinds = append(kinds, strings.Join(parts, "+"))
		}
		slices.Sort(kinds)
		t.Logf("%d EVALSHA calls; %d distinct scripts, each a concatenation of the Lua files: %v", len(evalshas), len(shas), kinds)
		if len(shas) == 0 {
			t.Error("no script text was sent; the test saw nothing")
		}
	})
}

// loadRecorder is a go-redis hook that keeps every script text the client
// sends (SCRIPT LOAD, EVAL) and every EVALSHA hash.
type loadRecorder struct {
	mu     sync.Mutex
	text   []string
	hashes []string
}

func (*loadRecorder) DialHook(next redis.DialHook) redis.DialHook { return next }
func (*loadRecorder) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (r *loadRecorder) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		args := cmd.Args()
		name := strings.ToLower(fmt.Sprint(args[0]))
		r.mu.Lock()
		switch {
		case name == "script" && len(args) > 2 && strings.EqualFold(fmt.Sprint(args[1]), "load"):
			r.text = append(r.text, fmt.Sprint(args[2]))
		case (name == "eval" || name == "eval_ro") && len(args) > 1:
			r.text = append(r.text, fmt.Sprint(args[1]))
		case (name == "evalsha" || name == "evalsha_ro") && len(args) > 1:
			r.hashes = append(r.hashes, fmt.Sprint(args[1]))
		}
		r.mu.Unlock()
		return next(ctx, cmd)
	}
}

func (r *loadRecorder) texts() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.text)
}

func (r *loadRecorder) evalshas() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.hashes)
}
