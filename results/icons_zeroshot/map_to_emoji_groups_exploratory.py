# Exploratory: publisher category -> emoji group, by a word shared with an emoji group/subgroup name (stated a priori).
import os, sys
A, F, T, ACT, O, P, SM, SY = "Animals & Nature", "Food & Drink", "Travel & Places", "Activities", "Objects", "People & Body", "Smileys & Emotion", "Symbols"
MAPS = {
 "icons-icon-park": {"animals": A, "foods": F, "sports": ACT, "game": ACT, "clothes": O, "music": O, "money": O,
                     "office": O, "hands": P, "peoples": P, "weather": T, "travel": T, "time": T, "arrows": SY},
 "icons-streamline-ultimate-color": {"food_drinks": F, "sports": ACT, "entertainment_events_hobbies": ACT,
     "transportation": T, "weather": T, "maps_navigation": T, "music_audio": O, "money_payments_finance": O,
     "science": O, "work_office_companies": O, "phones_mobile_devices": O, "computers_devices_electronics": O,
     "emails": O, "messages_chat_smileys": SM, "arrows_diagrams": SY},
}
src, name = sys.argv[1], os.path.basename(sys.argv[1])
dst = os.path.join(sys.argv[2] if len(sys.argv) > 2 else "mapped", name)  # the mapped copy: ARGV2/<set>
for cat, group in MAPS[name].items():
    os.makedirs(os.path.join(dst, group), exist_ok=True)
    for f in os.listdir(os.path.join(src, cat)):
        os.symlink(os.path.join(src, cat, f), os.path.join(dst, group, f"{cat}-{f}"))
print(dst, {g: len(os.listdir(os.path.join(dst, g))) for g in sorted(os.listdir(dst))})
