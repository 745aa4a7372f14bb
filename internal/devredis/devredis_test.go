package devredis

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

func TestKeysExpire(t *testing.T) {
	s, err := Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	rdb := redis.NewClient(&redis.Options{Addr: s.Addr()})
	defer rdb.Close()
	ctx := context.Background()
	if err := rdb.Set(ctx, "k", "v", 500*time.Millisecond).Err(); err != nil {
		t.Fatal(err)
	}
	for end := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		n, err := rdb.Exists(ctx, "k").Result()
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			break
		}
		if time.Now().After(end) {
			t.Fatal("a key with a 500ms TTL still exists after 5s")
		}
	}
	if s.URL() != "redis://"+s.Addr()+"/0" {
		t.Errorf("URL %q", s.URL())
	}
}
