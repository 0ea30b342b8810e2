#!/bin/sh
# Regenerates the TLS files of tests/otel.rs's collectors (OpenSSL 3):
# a test CA, the collector's certificate for 127.0.0.1 and localhost
# signed by it, and a second CA that signed nothing (the certificate a
# router must not accept the collector with). Valid for 100 years.
set -e
cd "$(dirname "$0")"
days=36500
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -days $days -subj "/CN=affinity-router test CA" -keyout ca.key -out ca.pem
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -days $days -subj "/CN=unrelated test CA" -keyout other-ca.key -out other-ca.pem
openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -subj "/CN=otlp-test-collector" -keyout collector.key -out collector.csr
printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n' > collector.ext
openssl x509 -req -in collector.csr -CA ca.pem -CAkey ca.key -CAcreateserial \
  -days $days -extfile collector.ext -out collector.pem
rm -f collector.csr collector.ext ca.srl ca.key other-ca.key
