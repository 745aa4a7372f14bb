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

// PayloadFile is a JSON-lines file of payloads, one task each, as
// ReadPayloads read it.
type PayloadFile struct {
	// Name is the path the file was read from, for messages.
	Name string
	// Payloads are its JSON values, in order, without the blank lines.
	Payloads [][]byte
	// Lines[i] is the line (from 1) Payloads[i] was read from.
	Lines []int
}

// Where names payload i in messages: "file:line". Set it as a Batch's
// Where.
func (f *PayloadFile) Where(i int) string {
	return fmt.Sprintf("%s:%d", f.Name, f.Lines[i])
}

// ReadPayloads reads a JSON-lines file: one JSON value per line, each the
// payload of one task. Blank lines are skipped. An invalid line is an
// error naming the file and the line; so is a file of more than MaxCount
// payloads, which no batch can hold.
func ReadPayloads(path string) (*PayloadFile, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := &PayloadFile{Name: path}
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
		if len(out.Payloads) == MaxCount {
			return nil, fmt.Errorf("%s:%d: more than %d payloads, the most one batch holds; split the file", path, line, MaxCount)
		}
		out.Payloads = append(out.Payloads, bytes.Clone(b))
		out.Lines = append(out.Lines, line)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w (lines are limited to %d MiB)", path, err, maxPayloadLine>>20)
	}
	return out, nil
}
