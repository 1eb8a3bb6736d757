// Package audit is carreld's tamper-evident, append-only audit log: every
// action, decision and byte of output lands here before (intents) or after
// (outcomes) it happens, on the host, where the guest cannot reach it.
//
// # On disk
//
// One directory holds one log:
//
//	records.log       the live segment, frames: [u32 LE length][u32 LE
//	                  CRC-32C of payload][payload]
//	segments/         older segments, rolled out of records.log whole:
//	                  <first seq>-<last seq>.log (%020d each), read-only; and
//	                  <name>.archived, the manifest of one moved elsewhere
//	hashes.db         tlog stored hashes, 32 bytes each, hash i at offset 32*i
//	checkpoints/      the newest signed notes, one per checkpoint, named by tree
//	                  size (%020d), with witnesses' cosignatures when they have
//	                  them; the older ones packed into checkpoints/packed
//	witnesses/        per witness, the last tree size it cosigned
//	sealed/TIME/      a damaged log RecoverCorrupt sealed, read-only
//	blobs/sha256/ab/… content-addressed blobs (stdin/stdout/stderr, file contents)
//	key, key.pub      the checkpoint signing key (0600) and its verifier key
//	lock              flock: one writer per directory
//
// A payload is one [Record] as JSON with a fixed field order (seq, time,
// kind, vm, session, provenance, intent, blobs, data). Records are the
// leaves of an RFC 6962 Merkle tree: leaf i is tlog.RecordHash(payload i)
// (golang.org/x/mod/sumdb/tlog). A checkpoint is a note
// (golang.org/x/mod/sumdb/note) signed with an Ed25519 key named for the
// log's origin ("carrel-audit" unless Options.Origin names it), whose
// text is a C2SP tlog checkpoint:
//
//	carrel-audit
//	<tree size>
//	<base64 root hash>
//
// The segments, in order, are the source of truth: laid end to end they
// are byte for byte the one records.log there would be without rolling,
// and offsets are offsets in that whole. hashes.db is derived from them
// (it makes proofs and tree heads cheap) and is rebuilt when it lags.
// Open reads only records.log.
//
// # Guarantees
//
//   - Durable: Append returns only after its record is written and
//     fdatasync'd. Concurrent appends are group-committed: one write and one
//     fdatasync per batch, one batch at a time; records queue while a batch
//     is being made durable and form the next. [Log.AppendAll] queues its
//     records together, so they share one batch where they fit in one.
//   - Dense: sequence numbers start at 0 and have no gaps; a failed batch
//     consumes none.
//   - Write-ahead: [Log.Begin] makes an "action.intent" record durable before
//     the action may run ([Log.BeginAfter]: with the records that admit it,
//     in the same batch); [Pending.End] appends its outcome, a record whose
//     intent field is the intent's seq.
//   - Crash recovery: [Open] truncates a torn tail: a bad frame (cut short,
//     impossible length or bad CRC) that can only be part of the one batch
//     written and not yet acknowledged, because it lies within one batch's
//     size of the end and any good frames after it share one commit time.
//     It then appends, durably, an "audit.recovery" record saying what it
//     cut, and for each intent left without an outcome an "action.outcome"
//     record (provenance host, the intent's vm and session) with data
//     {"outcome":"unknown","reason":"carreld stopped before the action
//     finished"}. Damage anywhere else, or a signed checkpoint larger than
//     the records, is an error ([ErrCorrupt], [ErrRecordsLost],
//     [ErrCheckpointMismatch]): Open never discards evidence silently;
//     [RecoverCorrupt] is the explicit step that seals such a log and starts
//     a new one chained to it.
//   - Fail closed: when a write or fsync fails the log turns unavailable:
//     appends fail with [ErrUnavailable] until a background probe succeeds,
//     and Options.OnFault and Options.OnRecover tell the caller. The probe
//     writes an "audit.recovery" record that says how long the log was
//     unavailable and how many appends it refused, and then the outcomes
//     (records that end an intent) it refused or failed meanwhile, kept
//     in memory, so that an outage leaves no intent open.
//   - Signed: a checkpoint is written every Options.CheckpointEvery records,
//     every Options.CheckpointInterval when there are new records, and on
//     Close, after hashes.db is synced, with file and directory fsync'd.
//   - Segmented: records.log rolls over, between batches, once it holds
//     Options.SegmentBytes or its first record is older than
//     Options.SegmentAge: the checkpoint at its end is signed and synced,
//     it is renamed into segments/, and the new records.log's first record,
//     durable before any other, is an "audit.segment" record naming the
//     segment before, its size, that checkpoint and the intents still open
//     (a crash between the rename and that record: Open writes it). [Archive]
//     moves rotated segments elsewhere, leaving a manifest; Verify checks
//     the log through the checkpoint at their end, and reports them.
//   - Verifiable offline: [Verify] recomputes every leaf and the root at
//     every checkpoint, and reports each flipped, dropped, reordered or
//     truncated record, forged checkpoint and replaced blob with its
//     position.
//
// Open checks frames, sequence numbers and the latest checkpoint's root; it
// hashes only the records after that checkpoint. Full verification is
// [Verify]'s job.
package audit
