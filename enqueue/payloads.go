package enqueue

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
)

// maxPayloadLine bounds one line of a payloads file.
const maxPayloadLine = 16 << 20

// ReadPayloads reads a JSON-lines file: one JSON value per line, each the
// payload of one task. Blank lines are skipped. An invalid line is an
// error naming the file and the line.
func ReadPayloads(path string) ([][]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out [][]byte
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), maxPayloadLine)
	for line := 1; sc.Scan(); line++ {
		b := bytes.TrimSpace(sc.Bytes())
		if len(b) == 0 {
			continue
		}
		if !json.Valid(b) {
			return nil, fmt.Errorf("%s:%d: not a JSON value; write one JSON payload per line", path, line)
		}
		out = append(out, bytes.Clone(b))
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w (lines are limited to %d MiB)", path, err, maxPayloadLine>>20)
	}
	return out, nil
}
