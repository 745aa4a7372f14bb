package redisurl

import (
	"bufio"
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

func TestOpenRedis(t *testing.T) {
	t.Run("standalone", func(t *testing.T) {
		c, err := Open("rediss://app:s3cret@db.example:6380/2?dial_timeout=3s")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		o := c.(*redis.Client).Options()
		if o.Addr != "db.example:6380" || o.Username != "app" || o.Password != "s3cret" || o.DB != 2 || o.TLSConfig == nil {
			t.Errorf("options %+v", o)
		}
	})
	t.Run("unix", func(t *testing.T) {
		c, err := Open("unix:///run/redis.sock?db=3")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if o := c.(*redis.Client).Options(); o.Network != "unix" || o.Addr != "/run/redis.sock" || o.DB != 3 {
			t.Errorf("options %+v", o)
		}
	})
	for _, u := range []string{"redis-cluster://:pw@h1:7000,h2:7001,h3:7002", "redis://:pw@h1:7000,h2:7001,h3:7002/0"} {
		t.Run("cluster "+u, func(t *testing.T) {
			c, err := Open(u)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			o := c.(*redis.ClusterClient).Options()
			if strings.Join(o.Addrs, ",") != "h1:7000,h2:7001,h3:7002" || o.Password != "pw" || o.TLSConfig != nil {
				t.Errorf("options %+v", o)
			}
		})
	}
	t.Run("cluster tls", func(t *testing.T) {
		c, err := Open("rediss-cluster://h1:7000,h2:7001")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if o := c.(*redis.ClusterClient).Options(); len(o.Addrs) != 2 || o.TLSConfig == nil {
			t.Errorf("options %+v", o)
		}
	})
	t.Run("sentinel", func(t *testing.T) {
		c, err := Open("redis-sentinel://:sentpw@s1:26379,s2:26379/mymaster/1?password=masterpw")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, ok := c.(*redis.Client); !ok {
			t.Fatalf("got %T, want a failover *redis.Client", c)
		}
		o := c.(*redis.Client).Options()
		if o.Password != "masterpw" || o.DB != 1 {
			t.Errorf("master options %+v", o)
		}
	})
}

func TestOpenRedisErrors(t *testing.T) {
	for _, tc := range []struct{ url, want string }{
		{"", "empty Redis URL"},
		{"user:hunter2@host:6379", "Redis URL (a Redis URL without scheme://): redis: invalid URL scheme: user"},
		{"redis://user:hunter2@host:notaport/0", `Redis URL redis://(does not parse): invalid port ":notaport" after host`},
		{"redis://user:hunter2@host:6379/x", `Redis URL redis://user:xxxxx@host:6379/x: redis: invalid database number: "x"`},
		{"http://user:hunter2@host:6379", `Redis URL http://user:xxxxx@host:6379: redis: invalid URL scheme: http`},
		{"redis://host:6379/?password=hunter2&bogus=1", `Redis URL redis://host:6379/?bogus=1&password=xxxxx: redis: unexpected option: bogus`},
		{"redis-sentinel://:hunter2@s1:26379", `Redis URL redis-sentinel://:xxxxx@s1:26379: the path must be /<master name>[/<db>]`},
		{"redis-cluster://:hunter2@h1:1,h2:2/3", `Redis URL redis-cluster://:xxxxx@h1:1,h2:2/3: Redis Cluster has only database 0`},
		{"redis://:hunter2@h1:1,h2:2?dial_timeout=x", `Redis URL redis://:xxxxx@h1:1,h2:2?dial_timeout=x: redis: invalid dial_timeout`},
	} {
		t.Run(tc.url, func(t *testing.T) {
			c, err := Open(tc.url)
			if err == nil {
				c.Close()
				t.Fatal("no error")
			}
			if strings.Contains(err.Error(), "hunter2") {
				t.Errorf("error shows the password: %v", err)
			}
			if !strings.HasPrefix(err.Error(), tc.want) {
				t.Errorf("got  %v\nwant %s…", err, tc.want)
			}
		})
	}
}

func TestRedactURL(t *testing.T) {
	for in, want := range map[string]string{
		"redis://127.0.0.1:6379/0":                     "redis://127.0.0.1:6379/0",
		"redis://:pw@h:1/0":                            "redis://:xxxxx@h:1/0",
		"rediss://user:p%40ss@h:1":                     "rediss://user:xxxxx@h:1",
		"redis://user@h:1":                             "redis://user@h:1",
		"redis-sentinel://s:1/m?password=pw&db=2":      "redis-sentinel://s:1/m?db=2&password=xxxxx",
		"redis://h:1?sentinel_password=x":              "redis://h:1?sentinel_password=xxxxx",
		"redis://user:pw@host:bad":                     "redis://(does not parse)",
		"user:pw@host:6379":                            "(a Redis URL without scheme://)",
		"hunter2":                                      "(a Redis URL without scheme://)",
		"redis//:hunter2@host:1":                       "(a Redis URL without scheme://)",
		"%zz:pw@host":                                  "(a Redis URL that does not parse)",
		"redis-cluster://:pw@a:1,b:2":                  "redis-cluster://:xxxxx@a:1,b:2",
		"unix://:pw@/run/redis.sock?db=1&password=pw2": "unix://:xxxxx@/run/redis.sock?db=1&password=xxxxx",
	} {
		if got := Redact(in); got != want {
			t.Errorf("Redact(%q) = %q, want %q", in, got, want)
		}
	}
}

// Ping's errors say what the server answered, never with the password:
// refused credentials are an authentication failure, not silence.
func TestPing(t *testing.T) {
	guarded := miniredis.RunT(t)
	guarded.RequireAuth("the-right-one")
	loading := answerEverything(t, "-LOADING Redis is loading the dataset in memory\r\n")
	redis5 := answerEverything(t, "-ERR Client sent AUTH, but no password is set\r\n")
	cases := []struct {
		name, url, want string
	}{
		{"wrong password", "redis://:hunter2secret@" + guarded.Addr(), "Redis at redis://:xxxxx@" + guarded.Addr() + ": authentication failed (WRONGPASS"},
		{"no password", "redis://" + guarded.Addr(), "wants a password and the URL gives none"},
		{"password to a Redis 5 without one", "redis://:hunter2secret@" + redis5, "has no password, but the URL gives one"},
		{"another error", "redis://" + loading, "answered PING with an error: LOADING"},
		{"no server", "redis://:hunter2secret@127.0.0.1:1/0?dial_timeout=1s", "Redis at redis://:xxxxx@127.0.0.1:1/0?dial_timeout=1s does not answer: dial tcp 127.0.0.1:1"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rdb, err := Open(c.url)
			if err != nil {
				t.Fatal(err)
			}
			defer rdb.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			err = Ping(ctx, rdb, c.url)
			if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "hunter2") {
				t.Errorf("Ping = %v\nwant it to contain %q and no password", err, c.want)
			}
		})
	}
	rdb, _ := Open("redis://:the-right-one@" + guarded.Addr())
	defer rdb.Close()
	if err := Ping(context.Background(), rdb, "redis://:the-right-one@"+guarded.Addr()); err != nil {
		t.Errorf("Ping with the right password = %v", err)
	}
}

// answerEverything serves a fake Redis that answers every command with
// reply, and returns its address.
func answerEverything(t *testing.T, reply string) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				r := bufio.NewReader(conn)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					if strings.HasPrefix(line, "*") { // a new command
						if _, err := conn.Write([]byte(reply)); err != nil {
							return
						}
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}
