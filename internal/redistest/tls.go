package redistest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// certValidity is how long the generated certificates are valid.
const certValidity = time.Hour

// TLSFiles are the PEM files of a throwaway certificate authority and of a
// server certificate it signed for 127.0.0.1, ::1 and localhost, as made by
// [TLSServer].
type TLSFiles struct {
	// CAFile holds the CA certificate.
	CAFile string
	// CertFile holds the server certificate.
	CertFile string
	// KeyFile holds the server's private key (PKCS #8).
	KeyFile string

	roots *x509.CertPool
}

// ClientConfig returns a new TLS client configuration that trusts only the
// test CA and verifies the server as 127.0.0.1.
func (f *TLSFiles) ClientConfig() *tls.Config {
	return &tls.Config{
		RootCAs:    f.roots,
		ServerName: "127.0.0.1", // an IP literal: verified against the IP SAN
		MinVersion: tls.VersionTLS12,
	}
}

// TLSServer is [Server] over TLS only: it generates a CA and a server
// certificate (ECDSA P-256, valid for an hour) into a t.TempDir() and starts
// redis-server with its plain port disabled and its TLS port on a free port,
// not asking clients for certificates. Connect with [Proc.Client] or with
// [TLSFiles.ClientConfig].
func TLSServer(t testing.TB, opts ...Option) (*Proc, *TLSFiles) {
	t.Helper()
	dir := t.TempDir()
	caCert, caKey := newCA(t, "jobthrottle test CA")

	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatalf("redistest: generating server key: %v", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial(t),
		Subject:      pkix.Name{CommonName: "127.0.0.1"},
		NotBefore:    now.Add(-time.Minute),
		NotAfter:     now.Add(certValidity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		// ClientAuth too, so the same pair works if a test turns on
		// tls-auth-clients or TLS replication.
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
		DNSNames:    []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatalf("redistest: signing server certificate: %v", err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatalf("redistest: encoding server key: %v", err)
	}

	files := &TLSFiles{
		CAFile:   filepath.Join(dir, "ca.crt"),
		CertFile: filepath.Join(dir, "server.crt"),
		KeyFile:  filepath.Join(dir, "server.key"),
		roots:    x509.NewCertPool(),
	}
	files.roots.AddCert(caCert)
	writePEM(t, files.CAFile, "CERTIFICATE", caCert.Raw)
	writePEM(t, files.CertFile, "CERTIFICATE", der)
	writePEM(t, files.KeyFile, "PRIVATE KEY", keyDER)

	cfg := serverConfig{tls: files}
	for _, o := range opts {
		o(&cfg)
	}
	return startProc(t, cfg), files
}

// OtherCA returns a pool holding only a freshly generated CA that signed
// nothing, for tests that a client refuses a server it should not trust.
func OtherCA(t testing.TB) *x509.CertPool {
	t.Helper()
	cert, _ := newCA(t, "unrelated test CA")
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return pool
}

// newCA generates a self-signed CA certificate valid for certValidity.
func newCA(t testing.TB, name string) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatalf("redistest: generating CA key: %v", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(t),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             now.Add(-time.Minute),
		NotAfter:              now.Add(certValidity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatalf("redistest: creating CA certificate: %v", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatalf("redistest: parsing CA certificate: %v", err)
	}
	return cert, key
}

func serial(t testing.TB) *big.Int {
	t.Helper()
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		t.Fatalf("redistest: certificate serial: %v", err)
	}
	return n
}

func writePEM(t testing.TB, path, typ string, der []byte) {
	t.Helper()
	data := pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der})
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatalf("redistest: %v", err)
	}
}
