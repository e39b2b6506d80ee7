//! Steps persisted under the state directory (a restarted agent resumes them): bounded files,
//! the newest kept, a broken file quarantined, never lost silently. The step layer is pure:
//! the daemon owns this store and writes what the step's transitions leave.
use crate::step::Step;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Where steps live: `<state_dir>/steps/<id>.json`, and in memory: files are read once at
/// startup (bounded in size; corrupt or oversized ones are quarantined with a log line), so
/// requests never parse files.
pub struct StepStore {
    dir: PathBuf,
    steps: std::sync::Mutex<BTreeMap<String, Step>>,
    /// Steps whose latest record could not be written, with the error (written again by
    /// [`StepStore::retry_unsaved`]).
    unsaved: std::sync::Mutex<BTreeMap<String, String>>,
    /// Writes that failed since start.
    pub write_errors: std::sync::atomic::AtomicU64,
    /// The last write that failed, until one succeeds (any record: a refused new step too).
    last_failed: std::sync::Mutex<Option<String>>,
}

/// A step file larger than this is not read (a step's record is bounded far below it).
pub const MAX_STEP_FILE: u64 = 8 << 20;

/// Steps kept (on disk and in memory).
pub const KEEP_STEPS: usize = 100;

impl StepStore {
    pub fn new(state_dir: &Path) -> std::io::Result<Self> {
        let dir = state_dir.join("steps");
        std::fs::create_dir_all(&dir)?;
        let store = Self {
            steps: std::sync::Mutex::new(Self::read_all(&dir)),
            dir,
            unsaved: Default::default(),
            write_errors: Default::default(),
            last_failed: Default::default(),
        };
        Ok(store)
    }

    pub(super) fn quarantine(path: &Path, why: &str) {
        let to = path.with_extension("quarantined");
        match std::fs::rename(path, &to) {
            Ok(()) => {
                tracing::warn!(file = %path.display(), moved_to = %to.display(), "{why}: step file quarantined")
            }
            Err(e) => {
                tracing::warn!(file = %path.display(), error = %e, "{why}; cannot quarantine it")
            }
        }
    }

    pub(super) fn read_all(dir: &Path) -> BTreeMap<String, Step> {
        let mut steps = BTreeMap::new();
        let Ok(rd) = std::fs::read_dir(dir) else {
            return steps;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') && name.ends_with(".json.tmp") {
                // A write that did not finish (a full disk, a crash): its record is not whole.
                let _ = std::fs::remove_file(e.path());
                continue;
            }
            if !name.ends_with(".json") || name.starts_with('.') {
                continue;
            }
            let path = e.path();
            match e.metadata() {
                Ok(m) if m.len() > MAX_STEP_FILE => {
                    Self::quarantine(
                        &path,
                        &format!("{} bytes is more than a step record", m.len()),
                    );
                    continue;
                }
                Err(_) => continue,
                Ok(_) => {}
            }
            match std::fs::read(&path).map(|d| serde_json::from_slice::<Step>(&d)) {
                // The id names the file the step is written to (and pruned from): one that
                // is no valid id, or not this file's name, is not this store's record.
                Ok(Ok(s))
                    if !crate::step::admission::valid_id(&s.id)
                        || name != format!("{}.json", s.id) =>
                {
                    Self::quarantine(
                        &path,
                        &format!(
                            "its id {:?} is not a step id naming this file",
                            s.id.chars().take(80).collect::<String>()
                        ),
                    )
                }
                Ok(Ok(s)) => {
                    steps.insert(s.id.clone(), s);
                }
                Ok(Err(err)) => Self::quarantine(&path, &format!("not a step record ({err})")),
                Err(err) => {
                    tracing::warn!(file = %path.display(), error = %err, "cannot read a step file")
                }
            }
        }
        steps
    }

    pub(super) fn mem(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Step>> {
        crate::locks::lock(&self.steps)
    }

    /// Saves a step to disk (written to a temporary file, fsynced, renamed, the directory
    /// fsynced) and keeps it in memory. A step already known is updated in memory first, so
    /// its verdict is served even when the disk refuses the write (the step then says it is
    /// not persisted, and the write is tried again); a new step is kept only once it is on
    /// disk.
    pub fn save(&self, s: &Step) -> std::io::Result<()> {
        let mut on_disk = s.clone();
        on_disk.not_persisted = None;
        let known = {
            let mut m = self.mem();
            match m.get_mut(&s.id) {
                Some(k) => {
                    *k = on_disk.clone();
                    true
                }
                None => false,
            }
        };
        let written = self.write(&on_disk);
        *crate::locks::lock(&self.last_failed) = written.as_ref().err().map(|e| e.to_string());
        match written {
            Ok(()) => {
                self.unsaved_mut().remove(&s.id);
                self.mem().insert(s.id.clone(), on_disk);
                Ok(())
            }
            Err(e) => {
                self.write_errors
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if known {
                    let why = format!("the step's record could not be written: {e}");
                    if let Some(k) = self.mem().get_mut(&s.id) {
                        k.not_persisted = Some(why.clone());
                    }
                    self.unsaved_mut().insert(s.id.clone(), why);
                }
                Err(e)
            }
        }
    }

    /// Keeps a step the disk refused in memory, marked not persisted, to be written again by
    /// [`StepStore::retry_unsaved`].
    pub fn keep_unsaved(&self, s: &Step, why: String) {
        let mut on_disk = s.clone();
        on_disk.not_persisted = None;
        self.mem().insert(s.id.clone(), on_disk);
        if let Some(k) = self.mem().get_mut(&s.id) {
            k.not_persisted = Some(why.clone());
        }
        self.unsaved_mut().insert(s.id.clone(), why);
    }

    /// Records how a write to the state directory that is no step's (the steady snapshot)
    /// went: a failure keeps the agent unready until a later write succeeds.
    pub fn note_write(&self, r: &std::io::Result<()>) {
        let mut w = crate::locks::lock(&self.last_failed);
        match r {
            Ok(()) => *w = None,
            Err(e) => {
                self.write_errors
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                *w = Some(e.to_string());
            }
        }
    }

    pub(super) fn unsaved_mut(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, String>> {
        crate::locks::lock(&self.unsaved)
    }

    pub(super) fn write(&self, s: &Step) -> std::io::Result<()> {
        let path = self.dir.join(format!("{}.json", s.id));
        let tmp = self.dir.join(format!(".{}.json.tmp", s.id));
        crate::durable::write(&tmp, &path, &serde_json::to_vec(s)?)
    }

    /// Why some step's latest record is not on disk (readiness and the view say so).
    pub fn unsaved(&self) -> Option<String> {
        self.unsaved_mut().values().next().cloned()
    }

    /// Why the state directory is not taking writes: a step's record not on disk, or the last
    /// write failed (a refused step, the steady snapshot) and none succeeded since.
    pub fn write_problem(&self) -> Option<String> {
        self.unsaved()
            .or_else(|| crate::locks::lock(&self.last_failed).clone())
    }

    /// Writes again the steps whose last write failed; how many writes failed again.
    pub fn retry_unsaved(&self) -> usize {
        let ids: Vec<String> = self.unsaved_mut().keys().cloned().collect();
        let mut failed = 0;
        for id in ids {
            match self.load(&id) {
                Some(s) => failed += usize::from(self.save(&s).is_err()),
                None => {
                    self.unsaved_mut().remove(&id);
                }
            }
        }
        failed
    }

    pub fn load(&self, id: &str) -> Option<Step> {
        self.mem().get(id).cloned()
    }

    /// All steps, newest first.
    pub fn list(&self) -> Vec<Step> {
        let mut v: Vec<Step> = self.mem().values().cloned().collect();
        v.sort_by(|a: &Step, b: &Step| b.created_at.total_cmp(&a.created_at));
        v
    }

    /// Keeps the newest `keep` steps, and whatever their age the steps that may prove the
    /// cilium-agent's current start (those that saw the latest reloads:
    /// `step::proof::current`).
    pub fn prune(&self, keep: usize) {
        let all = self.list();
        let proofs: std::collections::BTreeSet<String> = crate::step::proof::current(&all)
            .into_iter()
            .map(|s| s.id.clone())
            .collect();
        for s in all.into_iter().skip(keep) {
            if proofs.contains(&s.id) {
                continue;
            }
            self.mem().remove(&s.id);
            let _ = std::fs::remove_file(self.dir.join(format!("{}.json", s.id)));
        }
    }
}

/// A fresh step id: `step-<unix seconds>-<4 hex>`.
pub fn new_id(now: f64) -> String {
    let r = getrandom::u32().unwrap_or_else(|_| std::process::id() ^ now.fract().to_bits() as u32);
    format!("step-{}-{:04x}", now as u64, r as u16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::step::{Baseline, StepParams, StepRequest};
    use std::time::Duration;

    fn bare() -> Step {
        let (_, params) =
            StepParams::from_request(&StepRequest::default(), Duration::from_millis(10), &[])
                .unwrap();
        Step::new(
            "s".into(),
            0.0,
            params,
            Baseline::default(),
            BTreeMap::new(),
        )
    }

    /// A corrupt step file and a 9 MiB file in the state dir: both set aside with a log
    /// line, neither parsed on a request; good steps still load.
    #[test]
    fn corrupt_and_oversized_step_files_are_quarantined() {
        let root = std::env::temp_dir().join(format!("sg-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let store = StepStore::new(&root).unwrap();
        store.save(&bare()).unwrap();
        std::fs::write(root.join("steps/broken.json"), b"{not json").unwrap();
        std::fs::write(
            root.join("steps/huge.json"),
            vec![b' '; (MAX_STEP_FILE + 1) as usize],
        )
        .unwrap();
        let store = StepStore::new(&root).unwrap();
        assert_eq!(store.list().len(), 1);
        assert!(store.load("s").is_some());
        assert!(root.join("steps/broken.quarantined").exists());
        assert!(root.join("steps/huge.quarantined").exists());
        assert!(!root.join("steps/broken.json").exists());
        let _ = std::fs::remove_dir_all(&root);
    }

    /// A planted record whose id climbs out of the directory, and one whose id is not its
    /// file's name: neither is loaded (a resume would write, and pruning delete, `<id>.json`
    /// wherever the id points), both are quarantined; nothing is written outside.
    #[test]
    fn ids_read_from_disk_are_held_to_the_apis_rule_and_their_file_name() {
        let root = std::env::temp_dir().join(format!("sg-ids-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let store = StepStore::new(&root).unwrap();
        let outside = root.join("PWNED");
        for (file, id) in [
            ("innocent", format!("/../../{}", outside.display())),
            ("other", "someone-else".to_string()),
        ] {
            let mut s = bare();
            s.id = id;
            std::fs::write(
                root.join(format!("steps/{file}.json")),
                serde_json::to_vec(&s).unwrap(),
            )
            .unwrap();
        }
        drop(store);
        let store = StepStore::new(&root).unwrap();
        assert!(store.list().is_empty(), "{:?}", store.list().len());
        for file in ["innocent", "other"] {
            assert!(root.join(format!("steps/{file}.quarantined")).exists());
        }
        store.prune(0);
        assert!(!root.join("PWNED.json").exists());
        let _ = std::fs::remove_dir_all(&root);
    }

    /// Pruning keeps the newest steps and, however old, the one that saw the latest
    /// datapath reload: the proof of the cilium-agent's current start.
    #[test]
    fn pruning_never_drops_the_proof_of_the_current_start() {
        let root = std::env::temp_dir().join(format!("sg-prune-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let store = StepStore::new(&root).unwrap();
        let mut proof = bare();
        proof.id = "proof".into();
        proof.created_at = 1.0;
        proof.reload.changed.insert("eth0".into(), (9, 2.0));
        store.save(&proof).unwrap();
        for i in 0..5 {
            let mut s = bare();
            s.id = format!("later-{i}");
            s.created_at = 10.0 + f64::from(i);
            store.save(&s).unwrap();
        }
        store.prune(3);
        let ids: Vec<String> = store.list().into_iter().map(|s| s.id).collect();
        assert_eq!(ids, ["later-4", "later-3", "later-2", "proof"]);
        assert!(root.join("steps/proof.json").exists());
        assert!(!root.join("steps/later-0.json").exists());
        let _ = std::fs::remove_dir_all(&root);
    }
}
